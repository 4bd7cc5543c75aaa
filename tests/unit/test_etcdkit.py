"""tests/etcdkit.py's own promise: a member whose free port was taken before it bound it
(another pytest worker's cluster, starting at the same moment) does not fail the test
that asked for a cluster; the cluster starts again on new ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.etcdkit import EtcdCluster, etcd_missing


@pytest.mark.timeout(120)
def test_a_port_taken_before_etcd_binds_it_is_a_cluster_on_new_ports(tmp_path: Path) -> None:
    why = etcd_missing()
    if why is not None:
        pytest.skip(why)
    cluster = EtcdCluster(tmp_path)
    taken = cluster.members[2].client_port
    with socket.create_server(("127.0.0.1", taken)):  # the other worker's, first
        cluster.start()
        try:
            assert f":{taken}" not in cluster.endpoints
        finally:
            cluster.close()
