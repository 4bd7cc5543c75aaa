"""`phalanx launch --live-recovery` across hosts (issue 27): the host of a non-zero rank is
torn down mid-run, training goes on on the store's host, a third host takes the lost
node's rank, its worker joins with a live peer's state, and the run ends with identical
replicas and an exact data ledger.

Each "host" is a network namespace; they meet on a bridge inside host A's namespace, as
machines on one switch: tearing host B down (SIGKILL of everything in its namespace, then
the namespace itself, with its end of the link) leaves A's address in place, and host C
plugs a fresh link into the same bridge. The loop is tests/faults/scripts/live_loop.py
(its ledger: one line per applied step with the sample offset after it and the world).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.e2e.test_multinode import _check, _ip, _netns_unavailable
from tests.faults.test_live import STEPS, _check_exact, _digests
from tests.launchkit import FAULT_SCRIPTS, REPO, clean_env, secret_file

pytestmark = pytest.mark.faults

LOOP = FAULT_SCRIPTS / "live_loop.py"
SUBNET = "10.213.11"
MASTER_IP = f"{SUBNET}.1"
PORT = 29531  # the namespaces are fresh and private: a fixed port collides with nothing
HOLD_STEP = STEPS - 15  # the world is whole again for the last steps
EVENT_S = 60.0


class Hosts:
    """Namespaces named after our pid; host A holds the bridge the others plug into."""

    def __init__(self) -> None:
        tag = f"phxh{os.getpid() % 100_000}"
        self.tag, self.made = tag, list[str]()
        self.a = self.add("a", 1)
        _check(_ip("-n", self.a, "link", "add", "phxbr", "type", "bridge"))
        _check(_ip("-n", self.a, "addr", "add", f"{MASTER_IP}/24", "dev", "phxbr"))
        _check(_ip("-n", self.a, "link", "set", "phxbr", "up"))

    def add(self, name: str, host: int) -> str:
        """A new host on the bridge (A itself: the bridge's own address)."""
        netns = f"{self.tag}{name}"
        _check(_ip("netns", "add", netns))
        self.made.append(netns)
        _check(_ip("-n", netns, "link", "set", "lo", "up"))
        if host > 1:
            inside, outside = f"{self.tag}{name}v", f"{self.tag}{name}p"
            _check(_ip("link", "add", inside, "netns", netns, "type", "veth",
                       "peer", "name", outside, "netns", self.a))  # fmt: skip
            _check(_ip("-n", self.a, "link", "set", outside, "master", "phxbr", "up"))
            _check(_ip("-n", netns, "addr", "add", f"{SUBNET}.{host}/24", "dev", inside))
            _check(_ip("-n", netns, "link", "set", inside, "up"))
        return netns

    def tear_down(self, netns: str) -> None:
        """Power the host off: SIGKILL everything in it, then remove it and its link."""
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                              timeout=10).stdout.split()  # fmt: skip
        for pid in map(int, pids):
            os.kill(pid, signal.SIGKILL)
        _check(_ip("netns", "del", netns))
        self.made.remove(netns)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    made = Hosts()
    try:
        yield made
    finally:
        for netns in list(made.made):
            made.tear_down(netns)


def _start(netns: str, node_rank: int, log: Path, ledger: Path) -> subprocess.Popen[bytes]:
    secret = secret_file(ledger.parent / "run.secret")  # the same file on every host
    flags = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", MASTER_IP,
             "--master-port", str(PORT), "--nproc-per-node", "1", "--live-recovery",
             "--live-stall-timeout", "5", "--rdzv-timeout", "60",
             "--run-secret-file", str(secret)]  # fmt: skip
    env = clean_env(LEDGER_DIR=str(ledger), STEPS=str(STEPS), PAUSE_S="0.05",
                    HOLD_STEP=str(HOLD_STEP), HOLD_WORLD="2", OMP_NUM_THREADS="1")  # fmt: skip
    argv = ["ip", "netns", "exec", netns, sys.executable, "-m", "phalanx", "launch", *flags]
    with log.open("wb") as out:
        return subprocess.Popen([*argv, str(LOOP)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _wait(
    what: str, seen: Callable[[], bool], procs: list[subprocess.Popen[bytes]], logs: list[Path]
) -> None:
    """Poll until `seen()` is true; fail at once, with the logs, if a launcher exits first."""
    deadline = time.monotonic() + EVENT_S
    while not seen():
        exited = [p.args for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            texts = "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs)
            raise AssertionError(f"{what}: never happened (exited: {exited})\n{texts}")
        time.sleep(0.05)


def _worlds_seen(ledger: Path) -> list[int]:
    path = ledger / "r0.jsonl"
    text = path.read_text() if path.exists() else ""
    return [int(w) for w in re.findall(r'"world": (\d+)', text)]


@pytest.mark.timeout(150)
def test_a_lost_host_is_replaced_by_a_new_one(hosts: Hosts, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    logs = [tmp_path / f"{name}.log" for name in "abc"]
    b = hosts.add("b", 2)
    procs = [_start(hosts.a, 0, logs[0], ledger), _start(b, 1, logs[1], ledger)]
    try:
        _wait("5 steps on two hosts", lambda: len(_worlds_seen(ledger)) >= 5, procs, logs)
        hosts.tear_down(b)
        procs[1].wait(timeout=10)
        running = procs[:1]
        _wait("a step on host A alone", lambda: 1 in _worlds_seen(ledger), running, logs)
        _wait("node 1 declared lost", lambda: "node 1 lost" in logs[0].read_text(), running,
              logs)  # fmt: skip
        c = hosts.add("c", 3)
        running.append(_start(c, 1, logs[2], ledger))
        for proc in running:
            proc.wait(timeout=90)
    finally:
        for proc in procs[:1] + running[1:]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    a_out, c_out = logs[0].read_text(), logs[2].read_text()
    assert [p.returncode for p in running] == [0, 0], a_out + c_out
    worlds = _check_exact(tmp_path)  # each step once, no sample skipped or seen twice
    first_alone, back = worlds.index(1), len(worlds) - worlds[::-1].index(1)
    assert set(worlds[:first_alone]) == {2} and set(worlds[first_alone:back]) == {1}
    assert set(worlds[back:]) == {2} and back <= HOLD_STEP, worlds
    assert "taking the place of lost node 1" in c_out and "replacement j1" in c_out, c_out
    assert re.search(r"\[j1\] joined: .*received=True", c_out), c_out
    assert "node 1 is back" in a_out and "nodes lost during the run: 1" in a_out, a_out
    done = _digests(a_out + c_out)
    assert len(done) == 1 and (a_out + c_out).count(f"done step={STEPS}") == 2, a_out + c_out


@pytest.mark.timeout(240)
def test_hsdp_across_two_hosts_takes_a_lost_shard_from_the_other_host(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The Trainer at zero_stage=3 with zero3_shard_size=2 on two hosts of 2 ranks: each
    host's ranks are a row of the 2 x 2 mesh, holding the whole model; the rows replicate.
    r1 (host A) dies in step 14: its shard comes from r3, its replica on host B, at step 13
    (nothing rolled back, no snapshot kept while the mesh was whole). A's launcher starts
    j1, which joins; the rows are the hosts again (r0 and j1 on A, r2 and r3 on B), each
    member ending on its column's shard, and every sample was trained once."""
    from tests.faults.test_live_trainer import SCRIPT, _check_epochs

    steps, out_dir, ledger = 60, tmp_path / "out", tmp_path / "ledger"
    ledger.mkdir()
    secret = secret_file(tmp_path / "run.secret")
    env = clean_env(LEDGER_DIR=str(ledger), OMP_NUM_THREADS="1", ZERO_STAGE="3",
                    ZERO3_SHARD_SIZE="2", KILL_MEMBER="r1", KILL_STEP="13", HOLD_STEP="25",
                    HOLD_WORLD="4")  # fmt: skip
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    b = hosts.add("b", 2)
    procs = []
    for node_rank, (netns, log) in enumerate(zip((hosts.a, b), logs, strict=True)):
        flags = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", MASTER_IP,
                 "--master-port", str(PORT), "--nproc-per-node", "2", "--live-recovery",
                 "--live-stall-timeout", "5", "--max-restarts", "1", "--rdzv-timeout", "60",
                 "--run-secret-file", str(secret)]  # fmt: skip
        argv = ["ip", "netns", "exec", netns, sys.executable, "-m", "phalanx", "launch", *flags]
        with log.open("wb") as sink:
            procs.append(subprocess.Popen([*argv, str(SCRIPT), str(out_dir), str(steps)],
                                          cwd=REPO, env=env, stdout=sink,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    try:
        for proc in procs:
            proc.wait(timeout=200)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = "\n".join(log.read_text() for log in logs)
    assert [p.returncode for p in procs] == [0, 0], text
    membership = (out_dir / "live_membership.jsonl").read_text().splitlines()
    first = re.search(r'"members": (\[[^]]*\]).*"step": (\d+)', membership[0])
    assert first is not None and first.groups() == ('["r0", "r2", "r3"]', "13"), membership
    assert "live recovery: 4 ranks (r0, r2, r3, j1)" in text, text
    worlds = _check_epochs(ledger, steps, out_dir)
    assert worlds[:13] == [4] * 13 and worlds[13] == 3 and worlds[-1] == 4, worlds
    entries = [json.loads(line) for path in ledger.glob("*.jsonl")
               for line in path.read_text().splitlines()]  # fmt: skip
    kept = [e for e in entries if e["world"] == 4 and e["copy_bytes"]]
    assert not kept, f"a snapshot was kept while every shard had a replica: {kept[:3]}"
    digest = dict(re.findall(r"\[(\w+)\] done step=\d+ loss=\S+ digest=(\S+)", text))
    assert digest.keys() == {"r0", "r2", "r3", "j1"}, text
    assert digest["r0"] == digest["r2"] and digest["j1"] == digest["r3"], digest  # columns
    assert digest["r0"] != digest["j1"], digest
    # The last checkpoint, written from the rows by host ([[r0, j1], [r2, r3]]), holds the
    # whole model: its sum is a row's, its two shards'.
    whole = tmp_path / "whole.pt"
    argv = [sys.executable, "-m", "phalanx", "consolidate", str(out_dir / f"checkpoint-{steps}")]
    subprocess.run([*argv, str(whole)], cwd=REPO, check=True, capture_output=True, timeout=120)
    model = torch.load(whole, weights_only=True)["model"]
    total = float(sum(t.double().sum() for t in model.values()))
    assert total == pytest.approx(float(digest["r0"]) + float(digest["j1"]), rel=1e-9), total
