"""The issue's store trial: three hosts (network namespaces), an etcd member and a
`phalanx launch --rdzv-backend etcd --live-recovery` on each. Node 0's host is torn down
mid-run, its etcd member with it: the other two nodes train on (two members of three
still agree), and a fourth host takes node rank 0 back, its worker joining as a
replacement; the run ends with one model and an exact data ledger.

The hosts plug into a bridge in a namespace of its own (a switch), so that tearing any
host down leaves the others' link in place. The loop is tests/faults/scripts/live_loop.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.test_multinode import _check, _ip, _netns_unavailable
from tests.etcdkit import EtcdCluster, etcd_missing
from tests.faults.test_live import STEPS, _check_exact, _digests
from tests.launchkit import FAULT_SCRIPTS, REPO, clean_env, secret_file

pytestmark = pytest.mark.faults

LOOP = FAULT_SCRIPTS / "live_loop.py"
SUBNET = "10.213.13"
HOLD_STEP = STEPS - 15  # the world is whole again for the last steps
EVENT_S = 90.0


class Lan:
    """Namespaces named after our pid, each plugged into the switch's bridge."""

    def __init__(self) -> None:
        self.tag, self.made = f"phxe{os.getpid() % 100_000}", list[str]()
        self.switch = self._netns("sw")
        _check(_ip("-n", self.switch, "link", "add", "phxbr", "type", "bridge"))
        _check(_ip("-n", self.switch, "link", "set", "phxbr", "up"))

    def _netns(self, name: str) -> str:
        netns = f"{self.tag}{name}"
        _check(_ip("netns", "add", netns))
        self.made.append(netns)
        _check(_ip("-n", netns, "link", "set", "lo", "up"))
        return netns

    def add(self, name: str, host: int) -> str:
        """A new host, SUBNET.<host>, on the switch."""
        netns = self._netns(name)
        inside, outside = f"{self.tag}{name}v", f"{self.tag}{name}p"
        _check(
            _ip("link", "add", inside, "netns", netns, "type", "veth", "peer", "name", outside,
                "netns", self.switch)
        )  # fmt: skip
        _check(_ip("-n", self.switch, "link", "set", outside, "master", "phxbr", "up"))
        _check(_ip("-n", netns, "addr", "add", f"{SUBNET}.{host}/24", "dev", inside))
        _check(_ip("-n", netns, "link", "set", inside, "up"))
        return netns

    def tear_down(self, netns: str) -> None:
        """Power the host off: SIGKILL everything in it, then remove it and its link."""
        pids = subprocess.run(
            ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10
        ).stdout.split()
        for pid in map(int, pids):
            os.kill(pid, signal.SIGKILL)
        _check(_ip("netns", "del", netns))
        self.made.remove(netns)


@pytest.fixture
def lan() -> Iterator[Lan]:
    reason = _netns_unavailable() or etcd_missing()
    if reason is not None:
        pytest.skip(reason)
    made = Lan()
    try:
        yield made
    finally:
        for netns in reversed(made.made):
            made.tear_down(netns)


class Run:
    """The launchers of one run, one per host."""

    def __init__(self, tmp_path: Path, endpoints: str) -> None:
        self.tmp, self.endpoints = tmp_path, endpoints
        self.ledger = tmp_path / "ledger"
        self.ledger.mkdir()
        self.secret = secret_file(tmp_path / "run.secret")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, netns: str, node_rank: int, script: list[str] | None = None, flags: str = ""
    ) -> None:
        """`phalanx launch` of node `node_rank` in `netns`: the live loop, or `script`."""
        flags += (
            f" --nnodes 3 --node-rank {node_rank} --nproc-per-node 1 --rdzv-backend etcd "
            f"--rdzv-endpoint {self.endpoints} --rdzv-id hosts --live-recovery "
            f"--live-stall-timeout 5 --rdzv-timeout 60 --run-secret-file {self.secret}"
        )
        env = clean_env(LEDGER_DIR=str(self.ledger), STEPS=str(STEPS), PAUSE_S="0.05",
                        HOLD_STEP=str(HOLD_STEP), HOLD_WORLD="3", OMP_NUM_THREADS="1",
                        SAVE_STEPS="10")  # fmt: skip
        argv = ["ip", "netns", "exec", netns, sys.executable, "-m", "phalanx", "launch"]
        with self.log(netns).open("wb") as out:
            self.procs[netns] = subprocess.Popen(
                [*argv, *flags.split(), *(script or [str(LOOP)])], cwd=REPO, env=env,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def log(self, netns: str) -> Path:
        return self.tmp / f"{netns}.log"

    def said(self, netns: str) -> str:
        return self.log(netns).read_text(errors="replace")

    def wait(self, what: str, seen: Callable[[], bool], running: list[str]) -> None:
        deadline = time.monotonic() + EVENT_S
        while not seen():
            exited = [n for n in running if self.procs[n].poll() is not None]
            if exited or time.monotonic() > deadline:
                texts = "\n".join(f"--- {n}\n{self.said(n)}" for n in self.procs)
                raise AssertionError(f"{what}: never happened (exited: {exited})\n{texts}")
            time.sleep(0.05)

    def finish(self, running: list[str]) -> None:
        """Until every launcher in `running` exits; at once when one fails (the others may
        wait for it for long)."""
        deadline = time.monotonic() + 2 * EVENT_S
        while any(self.procs[n].poll() is None for n in running):
            failed = [n for n in running if self.procs[n].poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                texts = "\n".join(f"--- {n}\n{self.said(n)}" for n in self.procs)
                raise AssertionError(f"failed: {failed}\n{texts}")
            time.sleep(0.1)

    def worlds(self, member: str) -> list[int]:
        path = self.ledger / f"{member}.jsonl"
        text = path.read_text() if path.exists() else ""
        return [int(w) for w in re.findall(r'"world": (\d+)', text)]


@pytest.mark.slow  # about 35 s: the loopback version is tests/faults/test_live_etcd.py
@pytest.mark.timeout(240)
def test_node_0s_host_and_its_etcd_member_torn_down_the_others_go_on(
    lan: Lan, three_hosts: tuple[list[str], EtcdCluster], tmp_path: Path
) -> None:
    hosts, cluster = three_hosts
    run = Run(tmp_path, cluster.endpoints)
    try:
        for node_rank, netns in enumerate(hosts):
            run.start(netns, node_rank)
        run.wait("5 steps on three hosts", lambda: len(run.worlds("r1")) >= 5, hosts)
        lan.tear_down(hosts[0])  # node 0's launcher, its worker and etcd member m0
        run.procs[hosts[0]].wait(timeout=10)
        running = hosts[1:]
        run.wait("a step on two hosts", lambda: 2 in run.worlds("r1"), running)
        lost = "node 0 lost"
        run.wait(lost, lambda: any(lost in run.said(n) for n in running), running)
        fourth = lan.add("h4", 4)
        run.start(fourth, 0)
        running.append(fourth)
        run.finish(running)
    finally:
        for proc in run.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = {netns: run.said(netns) for netns in running}
    assert [run.procs[n].returncode for n in running] == [0, 0, 0], said
    worlds = _check_exact(tmp_path)  # each step once, no sample skipped or seen twice
    first, back = worlds.index(2), len(worlds) - worlds[::-1].index(2)
    assert set(worlds[:first]) == {3} and set(worlds[first:back]) == {2}, worlds
    assert set(worlds[back:]) == {3} and back <= HOLD_STEP, worlds
    new = said[fourth]
    assert "taking the place of lost node 0" in new and "replacement j1" in new, new
    assert re.search(r"\[j1\] joined: .*received=True", new), new
    everything = "".join(said.values())
    assert len(_digests(everything)) == 1, everything
    assert everything.count(f"done step={STEPS}") == 3, everything


@pytest.fixture
def three_hosts(lan: Lan, tmp_path: Path) -> Iterator[tuple[list[str], EtcdCluster]]:
    """Hosts h1..h3 on the switch, an etcd member on each."""
    hosts = [lan.add(f"h{k}", k) for k in (1, 2, 3)]
    wrap = [["ip", "netns", "exec", netns] for netns in hosts]
    (tmp_path / "etcd").mkdir()
    cluster = EtcdCluster(tmp_path / "etcd", [f"{SUBNET}.{k}" for k in (1, 2, 3)], wrap)
    cluster.start()
    try:
        yield hosts, cluster
    finally:
        cluster.close()


@pytest.mark.slow  # about 30 s: the loopback version is tests/faults/test_live_etcd.py
@pytest.mark.timeout(240)
def test_two_etcd_members_stopped_every_rank_stops_in_one_line(
    three_hosts: tuple[list[str], EtcdCluster], tmp_path: Path
) -> None:
    from phalanx.train.checkpoint.directory import verify_checkpoint

    hosts, cluster = three_hosts
    run = Run(tmp_path, cluster.endpoints)
    out = tmp_path / "run"
    script = [str(FAULT_SCRIPTS / "live_trainer.py"), str(out), "100000"]
    try:
        for node_rank, netns in enumerate(hosts):
            run.start(netns, node_rank, script, "--rdzv-conf read_timeout=3")
        saved = out / "checkpoint-20" / "manifest.json"
        run.wait("checkpoint-20 written", saved.exists, hosts)
        cluster.stop(1)
        cluster.stop(2)  # one member of three left: no quorum
        deadline = time.monotonic() + EVENT_S
        while any(run.procs[n].poll() is None for n in hosts):
            assert time.monotonic() < deadline, {n: run.said(n) for n in hosts}
            time.sleep(0.1)
    finally:
        for proc in run.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = {n: run.said(n) for n in hosts}
    assert [run.procs[n].returncode for n in hosts] == [203] * 3, said
    for rank, netns in enumerate(hosts):
        lines = [line for line in said[netns].splitlines() if line.startswith(f"[rank {rank}]")]
        lost = [line for line in lines if "StoreLost: the job's store, etcd at" in line]
        assert len(lost) == 1 and "Traceback" not in said[netns], said[netns]
    newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
    verify_checkpoint(newest)  # every file there, each matching its checksum
