"""Two real hosts: two network namespaces joined by a veth pair, one `phalanx launch` in each.

Inside a namespace the hostname still resolves to 127.0.0.1 (as on many
machines and containers), so gloo would advertise loopback to the other host
and the job would die with "Connection refused" — unless the launcher points
GLOO_SOCKET_IFNAME at the veth that routes to the master, which is what this
proves. We only ever send traffic to the addresses we create inside our own
namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launchkit import listening_addresses, wait_for

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tests" / "e2e" / "scripts" / "train_mlp.py"
# A private link of our own; the namespaces are fresh, so no other traffic can reach it.
MASTER_IP, PEER_IP, PREFIX = "10.213.9.1", "10.213.9.2", 24
NPROC = 2
RUN_TIMEOUT_S = 150
IP_TIMEOUT_S = 10


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip") or "ip"
    return subprocess.run([ip, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)


def _netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"phxprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str


def _check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{result.args}: {result.stderr}"


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, named after our pid so concurrent runs never meet.

    The veth ends are created straight inside the namespaces, so nothing ever
    appears in the host's own namespace, and deleting the namespaces removes them.
    """
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    pid = os.getpid()
    hosts = (
        Host(f"phxl{pid}a", f"pxla{pid}", MASTER_IP),
        Host(f"phxl{pid}b", f"pxlb{pid}", PEER_IP),
    )
    made: list[str] = []
    try:
        for host in hosts:
            _check(_ip("netns", "add", host.netns))
            made.append(host.netns)
        (a, b) = hosts
        _check(_ip("link", "add", a.ifname, "netns", a.netns, "type", "veth",
                   "peer", "name", b.ifname, "netns", b.netns))  # fmt: skip
        for host in hosts:
            _check(_ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX}",
                       "dev", host.ifname))  # fmt: skip
            _check(_ip("-n", host.netns, "link", "set", host.ifname, "up"))
            _check(_ip("-n", host.netns, "link", "set", "lo", "up"))
        yield hosts
    finally:
        for netns in made:
            _ip("netns", "del", netns)


def _clean_env() -> dict[str, str]:
    """Our environment without interface choices, so the launcher has to make its own."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.pop("OMP_NUM_THREADS", None)
    return env


def _launch_argv(*flags: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "phalanx", "launch", *flags, str(TRAIN), str(out)]


def _node_argv(host: Host, node_rank: int, out: Path) -> list[str]:
    flags = [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        MASTER_IP,
        "--nproc-per-node",
        str(NPROC),
        "--rdzv-timeout",
        "60",
    ]
    ip = shutil.which("ip") or "ip"
    return [ip, "netns", "exec", host.netns, *_launch_argv(*flags, out=out)]


def _popen(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, cwd=REPO, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _run_nodes(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run the launchers side by side; a hang fails the test at RUN_TIMEOUT_S."""
    procs = [_popen(a) for a in argvs]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _params(out: Path, world: int) -> list[dict[str, object]]:
    records = [json.loads((out / f"params_{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in records] == list(range(world))
    assert all(r["world_size"] == world for r in records)
    return records


@pytest.mark.slow  # make test-slow: four training runs; the c10d test below stays in make test
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_two_hosts_train_like_one(two_hosts: tuple[Host, Host], tmp_path: Path) -> None:
    multi, single = tmp_path / "two_hosts", tmp_path / "one_host"
    multi.mkdir()
    single.mkdir()
    results = _run_nodes([_node_argv(h, rank, multi) for rank, h in enumerate(two_hosts)])
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} exited {code}\nstdout:\n{out}\nstderr:\n{err}"
        assert f"GLOO_SOCKET_IFNAME={two_hosts[node].ifname}" in err, err

    records = _params(multi, 2 * NPROC)
    for record in records:
        node = int(record["rank"]) // NPROC  # type: ignore[call-overload]
        assert record["node_rank"] == node
        assert record["ifname"] == two_hosts[node].ifname
    assert all(r["params"] == records[0]["params"] for r in records), "replicas diverged"

    ((code, out, err),) = _run_nodes([_launch_argv("--nproc-per-node", str(2 * NPROC), out=single)])
    assert code == 0, f"single-node run exited {code}\n{out}\n{err}"
    reference = _params(single, 2 * NPROC)[0]["params"]
    assert isinstance(reference, dict)
    for name, values in reference.items():
        got = records[0]["params"][name]  # type: ignore[index]
        worst = max(abs(a - b) for a, b in zip(got, values, strict=True))
        # Same ranks, same data, same all-reduce order: bit for bit, not just close.
        assert worst == 0.0, f"{name}: two hosts differ from one host by {worst}"


HOLD = REPO / "tests" / "faults" / "scripts" / "hold.py"
C10D_PORT = 29400


def _c10d_argv(host: Host, out: Path, *extra: str) -> list[str]:
    endpoint = f"{MASTER_IP}:{C10D_PORT}"
    flags = ["--nnodes", "2", "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-timeout", "60", *extra]  # fmt: skip
    ip = shutil.which("ip") or "ip"
    argv = [sys.executable, "-m", "phalanx", "launch", *flags, str(HOLD), str(out)]
    return [ip, "netns", "exec", host.netns, *argv]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_c10d_rendezvous_across_two_hosts(two_hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """No --node-rank: the launcher on the endpoint's host is node 0, the other joins as node
    1. While the job runs, the store listens on the master's veth address alone."""
    master, peer = two_hosts
    # Either may start first (the peer waits for the store); --local-addr names its own.
    argvs = [_c10d_argv(peer, tmp_path, "--local-addr", PEER_IP), _c10d_argv(master, tmp_path)]
    procs = [_popen(argv) for argv in argvs]
    procs.reverse()  # node order: master, peer
    try:
        wait_for([tmp_path / f"ready_{r}" for r in range(2 * NPROC)], timeout_s=RUN_TIMEOUT_S)
        listening = listening_addresses(C10D_PORT, netns=master.netns)
    finally:
        (tmp_path / "go").touch()
    outputs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} exited {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert listening == {MASTER_IP}
    assert "this is node 1 of 2" in results[1][2]
    assert f"the interface of --local-addr {PEER_IP}" in results[1][2]
    ready = [json.loads((tmp_path / f"ready_{r}").read_text()) for r in range(2 * NPROC)]
    assert [r["node"] for r in ready] == [0] * NPROC + [1] * NPROC
    assert [r["ifname"] for r in ready] == [master.ifname] * NPROC + [peer.ifname] * NPROC
    sums = {float((tmp_path / f"sum_{r}").read_text()) for r in range(2 * NPROC)}
    assert sums == {float(sum(range(1, 2 * NPROC + 1)))}
