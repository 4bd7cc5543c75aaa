"""--live-recovery with the job's store in etcd (--rdzv-backend etcd): node 0, whose launcher
would host the c10d store, is torn down mid-run (SIGKILL of its launcher and every process
it started), the other node trains on, and a new launcher takes node rank 0 back, its
worker joining as a replacement; the run ends with one model and an exact data ledger.

Two launchers on loopback, three etcd members on loopback (tests/etcdkit.py); the loop is
tests/faults/scripts/live_loop.py, as in tests/e2e/test_live_hosts.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.etcdkit import EtcdCluster
from tests.faults.test_live import STEPS, _check_exact, _digests
from tests.launchkit import FAULT_SCRIPTS, LAUNCH, REPO, clean_env, marked_processes, secret_file

pytestmark = pytest.mark.faults

LOOP = FAULT_SCRIPTS / "live_loop.py"
HOLD_STEP = STEPS - 15  # the world is whole again for the last steps
EVENT_S = 60.0


class Nodes:
    """Launchers of one run, each marked so that everything it started can be found."""

    def __init__(self, cluster: EtcdCluster, tmp_path: Path) -> None:
        self.cluster, self.tmp = cluster, tmp_path
        self.ledger = tmp_path / "ledger"
        self.ledger.mkdir()
        self.secret = secret_file(tmp_path / "run.secret")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, node_rank: int) -> None:
        flags = (
            f"--nnodes 2 --node-rank {node_rank} --nproc-per-node 1 --rdzv-backend etcd "
            f"--rdzv-endpoint {self.cluster.endpoints} --rdzv-id live-etcd --live-recovery "
            f"--live-stall-timeout 5 --rdzv-timeout 60 --run-secret-file {self.secret}"
        )
        env = clean_env(
            LEDGER_DIR=str(self.ledger),
            STEPS=str(STEPS),
            PAUSE_S="0.05",
            HOLD_STEP=str(HOLD_STEP),
            HOLD_WORLD="2",
            OMP_NUM_THREADS="1",
            PHALANX_TEST_MARK=f"{os.getpid()}-{name}",
        )
        self.logs[name] = log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            self.procs[name] = subprocess.Popen(
                [*LAUNCH, *flags.split(), str(LOOP)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def tear_down(self, name: str) -> None:
        """The host is gone: SIGKILL its launcher's group and everything the launcher
        started (workers run in sessions of their own)."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        mark = f"{os.getpid()}-{name}"
        deadline = time.monotonic() + EVENT_S
        while pids := marked_processes(mark):
            assert time.monotonic() < deadline, f"still running: {pids}"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        self.procs[name].wait(timeout=10)

    def said(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait(self, what: str, seen: Callable[[], bool], running: list[str]) -> None:
        """Poll until `seen()`; fail at once, with every log, if a running launcher exits."""
        deadline = time.monotonic() + EVENT_S
        while not seen():
            exited = [name for name in running if self.procs[name].poll() is not None]
            if exited or time.monotonic() > deadline:
                texts = "\n".join(f"--- {name}\n{self.said(name)}" for name in self.logs)
                raise AssertionError(f"{what}: never happened (exited: {exited})\n{texts}")
            time.sleep(0.05)

    def worlds(self, member: str) -> list[int]:
        path = self.ledger / f"{member}.jsonl"
        text = path.read_text() if path.exists() else ""
        return [int(w) for w in re.findall(r'"world": (\d+)', text)]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.timeout(170)
def test_losing_node_0_leaves_the_run_going_and_a_new_node_0_joins(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    nodes = Nodes(etcd_cluster, tmp_path)
    try:
        nodes.start("n0", 0)
        nodes.start("n1", 1)
        both = ["n0", "n1"]
        nodes.wait("5 steps on two nodes", lambda: len(nodes.worlds("r1")) >= 5, both)
        nodes.tear_down("n0")
        nodes.wait("a step on node 1 alone", lambda: 1 in nodes.worlds("r1"), ["n1"])
        nodes.wait("node 0 declared lost", lambda: "node 0 lost" in nodes.said("n1"), ["n1"])
        nodes.start("n0b", 0)
        for name in ("n1", "n0b"):
            nodes.procs[name].wait(timeout=90)
    finally:
        nodes.kill_all()
    one, back = nodes.said("n1"), nodes.said("n0b")
    assert [nodes.procs[n].returncode for n in ("n1", "n0b")] == [0, 0], one + back
    worlds = _check_exact(tmp_path)  # each step once, no sample skipped or seen twice
    first_alone, regrown = worlds.index(1), len(worlds) - worlds[::-1].index(1)
    assert set(worlds[:first_alone]) == {2} and set(worlds[first_alone:regrown]) == {1}
    assert set(worlds[regrown:]) == {2} and regrown <= HOLD_STEP, worlds
    assert "taking the place of lost node 0" in back and "replacement j1" in back, back
    assert re.search(r"\[j1\] joined: .*received=True", back), back
    assert "node 0 is back" in one and "nodes lost during the run: 0" in one, one
    done = _digests(one + back)
    assert len(done) == 1 and (one + back).count(f"done step={STEPS}") == 2, one + back


TRAINER = FAULT_SCRIPTS / "live_trainer.py"


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.rpartition("-")[2])


@pytest.mark.timeout(150)
def test_a_lost_quorum_stops_every_rank_in_one_line_and_keeps_the_checkpoint(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    from phalanx.train.checkpoint.directory import verify_checkpoint

    run, ledger, log = tmp_path / "run", tmp_path / "ledger", tmp_path / "launch.log"
    ledger.mkdir()
    flags = (
        f"--nproc-per-node 2 --rdzv-backend etcd --rdzv-endpoint {etcd_cluster.endpoints} "
        "--rdzv-conf read_timeout=3 --live-recovery --live-stall-timeout 5"
    )
    env = clean_env(LEDGER_DIR=str(ledger), OMP_NUM_THREADS="1", SAVE_STEPS="10")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*LAUNCH, *flags.split(), str(TRAINER), str(run), "100000"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + EVENT_S
        while not (run / "checkpoint-20" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        etcd_cluster.stop(1)
        etcd_cluster.stop(2)  # one member of three left: no quorum
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = log.read_text(errors="replace")
    assert proc.returncode == 203, said
    for rank in (0, 1):
        lines = [line for line in said.splitlines() if line.startswith(f"[rank {rank}]")]
        lost = [line for line in lines if "StoreLost: the job's store, etcd at" in line]
        assert len(lost) == 1, said
    assert "Traceback" not in said, said
    # A background save in flight when the store went may leave its staging folder
    # (checkpoint-<step>.<random>.tmp, which the next start names and removes); the
    # checkpoints themselves are whole.
    sealed = [path for path in run.glob("checkpoint-*") if path.name.rpartition("-")[2].isdigit()]
    newest = max(sealed, key=_step_of)
    assert _step_of(newest) >= 20
    verify_checkpoint(newest)  # every file there, each matching its checksum
    strays = [p.name for p in run.glob("checkpoint-*") if p not in sealed]
    assert all(name.endswith(".tmp") for name in strays), strays
