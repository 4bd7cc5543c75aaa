"""What every test starts from."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.disks import read_only_dir, small_disk
from tests.etcdkit import EtcdCluster, etcd_cluster_of, etcd_missing

# The fixtures every test may use.
__all__ = ["etcd_cluster", "no_group_left_behind", "read_only_dir", "small_disk"]


@pytest.fixture(autouse=True)
def no_group_left_behind() -> Iterator[None]:
    """Each test starts as a fresh process does: with no default process group.

    A Trainer made in pytest's own process joins a one-rank group and keeps it
    until `close()` or exit, as it would in a user's script; left in place, the
    next test would find that group and describe it instead of building its own.
    """
    yield
    dist = sys.modules.get("torch.distributed")  # never import torch for launcher-only tests
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three etcd members on loopback (tests/etcdkit.py); skipped where etcd is missing."""
    why = etcd_missing()
    if why is not None:
        pytest.skip(why)
    yield from etcd_cluster_of(tmp_path_factory.mktemp("etcd"))
