"""The rendezvous store listens on one address, not on every interface (issue 12, item 11).

torch's TCPStore listens on every interface, IPv4 and IPv6, where anyone on the
network can read and write its keys. A single-node job's store must listen on
loopback only, whether `phalanx launch` hosts it or rank 0 does (a hand-set
environment, as srun's). Checked from outside with `ss -ltn` while the job runs;
the multi-node case (the store on the one interface the other nodes dial) is in
tests/e2e/test_multinode.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.ports import free_port
from tests.launchkit import (
    FAULT_SCRIPTS,
    LAUNCH,
    clean_env,
    finish,
    listening_addresses,
    start,
    wait_for,
)

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss"),
]

HOLD = FAULT_SCRIPTS / "hold.py"


def _check_while_held(out: Path, procs: list[subprocess.Popen[str]], port: int) -> set[str]:
    """Where the store listens once both ranks have joined; then let the job finish."""
    try:
        wait_for([out / f"ready_{r}" for r in range(2)], timeout_s=120)
        where = listening_addresses(port)
    finally:
        (out / "go").touch()
    for proc in procs:
        _, err = finish(proc, timeout_s=60)
        assert proc.returncode == 0, err
    assert [float((out / f"sum_{r}").read_text()) for r in range(2)] == [3.0, 3.0]
    return where


@pytest.mark.timeout(240)
def test_launcher_hosted_store_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    launcher = start([*LAUNCH, "--nproc-per-node", 2, "--master-port", port, HOLD, tmp_path])
    assert _check_while_held(tmp_path, [launcher], port) == {"127.0.0.1"}


@pytest.mark.timeout(240)
def test_rank0_hosted_store_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    ranks = []
    for rank in range(2):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1")  # fmt: skip
        ranks.append(start([sys.executable, HOLD, tmp_path], env=env))
    assert _check_while_held(tmp_path, ranks, port) == {"127.0.0.1"}
    assert json.loads((tmp_path / "ready_1").read_text())["world"] == 2
