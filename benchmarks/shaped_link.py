"""Run a benchmark as if its ranks talked over a network of a given bandwidth.

On one machine gloo's ranks talk over loopback, where an all-reduce is a memory
copy: sending fewer bytes barely helps, and compressing them costs more than it
saves. To see what a method buys between machines, the benchmark re-runs
itself inside a private network namespace whose loopback is shaped by a token
bucket (`tc qdisc ... tbf`) to RATE Gbit/s. Every byte the ranks exchange,
collectives and store alike, then crosses a link of that rate, shared by both
directions as a real half of a switch port is not (a ring all-reduce at
world 2 sends as much each way: read the rate as about twice the per-direction
bandwidth of a real link).

Needs root and iproute2 (`ip`, `tc`), as the tests' two-host runs do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

INSIDE = "PHALANX_BENCH_LINK_GBIT"
"""Set in the re-run's environment: the link rate it runs behind (and no second re-run)."""

LOOPBACK_MTU = 65536


def tbf_args(gbit: float) -> list[str]:
    """`tc` arguments shaping a device to `gbit` Gbit/s.

    The bucket holds 1 ms of traffic but never less than two loopback frames
    (a bucket smaller than one frame passes nothing), and the queue holds
    100 ms, enough that a burst of sends waits instead of being dropped.
    """
    if not gbit > 0:
        raise ValueError(f"link rate {gbit!r} Gbit/s — give a positive rate, such as 1 or 10")
    bytes_per_s = gbit * 1e9 / 8
    burst = max(2 * LOOPBACK_MTU, int(bytes_per_s / 1000))
    return ["tbf", "rate", f"{gbit:g}gbit", "burst", str(burst), "latency", "100ms"]


def _needs_root(exc: BaseException, what: str) -> SystemExit:
    detail = getattr(exc, "stderr", "") or exc
    return SystemExit(f"network namespaces need root and iproute2 ({detail}) — run as root, {what}")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextmanager
def shaped_namespace(gbit: float) -> Iterator[str]:
    """A fresh network namespace, loopback up and shaped to `gbit`; its name. Deleted after."""
    name = f"phalanx-bench-{uuid.uuid4().hex[:8]}"
    try:
        _run("ip", "netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise _needs_root(exc, "or leave --link-gbit out to measure over plain loopback") from exc
    try:
        inside = ("ip", "netns", "exec", name)
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "tc", "qdisc", "add", "dev", "lo", "root", *tbf_args(gbit))
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def rerun_behind_link(gbit: float, script: str, argv: Sequence[str]) -> int:
    """Run `script` again with `argv`, inside a namespace shaped to `gbit`; its exit code."""
    with shaped_namespace(gbit) as name:
        env = {**os.environ, INSIDE: f"{gbit:g}"}
        cmd = ["ip", "netns", "exec", name, sys.executable, script, *argv]
        return subprocess.run(cmd, env=env).returncode


def link_rate() -> float | None:
    """The Gbit/s this process runs behind, when it is such a re-run."""
    value = os.environ.get(INSIDE)
    return float(value) if value else None


@dataclass(frozen=True)
class TwoHosts:
    """Two network namespaces ("hosts") joined by one veth link, each end shaped."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]


@contextmanager
def two_hosts(gbit: float, subnet: str = "10.213.9") -> Iterator[TwoHosts]:
    """Two fresh namespaces joined by a veth pair whose ends both send at `gbit` Gbit/s (each
    direction its own rate, as on a switched link); loopback up in each. Deleted after."""
    tag = uuid.uuid4().hex[:6]
    hosts = TwoHosts(
        (f"phx-h0-{tag}", f"phx-h1-{tag}"),
        (f"phx0{tag}", f"phx1{tag}"),
        (f"{subnet}.1", f"{subnet}.2"),
    )
    made: list[str] = []
    try:
        try:
            for ns in hosts.namespaces:
                _run("ip", "netns", "add", ns)
                made.append(ns)
            _run("ip", "link", "add", hosts.devices[0], "netns", hosts.namespaces[0],
                 "type", "veth", "peer", "name", hosts.devices[1],
                 "netns", hosts.namespaces[1])  # fmt: skip
            for ns, dev, addr in zip(hosts.namespaces, hosts.devices, hosts.addresses):
                inside = ("ip", "netns", "exec", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run(*inside, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(gbit))
        except (OSError, subprocess.CalledProcessError) as exc:
            raise _needs_root(exc, "to build the two hosts") from exc
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
