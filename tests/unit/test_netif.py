"""Interface selection against this host's real routing table and, where we may, a
network namespace we build ourselves."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx.ground import netif

# Addresses we create, only inside namespaces we create: a private /30 link.
NS_LOCAL, NS_PEER = "10.213.7.1", "10.213.7.2"


def _default_route() -> tuple[str, str] | None:
    """(interface, gateway) of the IPv4 default route, read straight from the kernel."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields[1] == "00000000" and fields[2] != "00000000":
            gateway = socket.inet_ntoa(struct.pack("=I", int(fields[2], 16)))
            return fields[0], gateway
    return None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_route_is_none(host: str) -> None:
    assert netif.is_loopback(host)
    assert netif.route_interface(host) is None


def test_hostname_that_resolves_to_loopback_routes_nowhere() -> None:
    name = socket.gethostname()
    if not netif.is_loopback(name):
        pytest.skip(f"{name} does not resolve to loopback here")
    assert netif.route_interface(name) is None


def test_unresolvable_host_is_neither_loopback_nor_routed() -> None:
    assert not netif.is_loopback("no-such-host.invalid")
    assert netif.route_interface("no-such-host.invalid") is None


def test_non_loopback_address_is_not_loopback() -> None:
    assert not netif.is_loopback("10.1.2.3")


def test_default_gateway_routes_through_the_default_interface() -> None:
    found = _default_route()
    if found is None:
        pytest.skip("no IPv4 default route on this host")
    interface, gateway = found
    # Connecting a UDP socket sends nothing: this only asks the kernel for a route.
    assert netif.route_interface(gateway) == interface


def test_each_interface_address_maps_back_to_its_interface() -> None:
    checked = 0
    for _index, name in socket.if_nameindex():
        address = netif.ipv4_address(name)
        if address is None or ipaddress.ip_address(address).is_loopback:
            continue
        assert netif.interface_for_address(address) == name
        assert netif.route_interface(address) == name
        checked += 1
    if not checked:
        pytest.skip("no interface with a non-loopback IPv4 address")


# --- inside network namespaces we build ----------------------------------------------


@dataclass(frozen=True)
class VethLink:
    """Two namespaces joined by a veth pair: `local_ns`/`local_if` hold NS_LOCAL."""

    local_ns: str
    local_if: str
    peer_ns: str
    peer_if: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@contextmanager
def veth_link() -> Iterator[VethLink]:
    """Build a private two-namespace link, and tear it down whatever happens.

    Skips the test where namespaces cannot be made (not root, no iproute2, a
    sandbox that forbids them). Names carry our pid so concurrent runs never meet.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to build network namespaces")
    tag = f"phx{os.getpid() % 1_000_000}"
    link = VethLink(f"{tag}a", f"{tag}va", f"{tag}b", f"{tag}vb")
    made: list[str] = []
    try:
        for ns in (link.local_ns, link.peer_ns):
            try:
                _ip("netns", "add", ns)
            except (subprocess.CalledProcessError, OSError) as exc:
                pytest.skip(f"cannot create a network namespace here: {exc}")
            made.append(ns)
        # Created straight inside the namespaces: nothing ever appears in the host's.
        _ip("link", "add", link.local_if, "netns", link.local_ns, "type", "veth",
            "peer", "name", link.peer_if, "netns", link.peer_ns)  # fmt: skip
        for ns, dev, addr in ((link.local_ns, link.local_if, NS_LOCAL),
                              (link.peer_ns, link.peer_if, NS_PEER)):  # fmt: skip
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield link
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def start_rank_in(ns: str, rank: int, port: int, *argv: str) -> subprocess.Popen[str]:
    """Rank `rank` of two, `python *argv` inside namespace `ns`, the master at NS_LOCAL:port
    (as one process per node: RANK, WORLD_SIZE, MASTER_ADDR; no GLOO_ or NCCL_ settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    env.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        MASTER_ADDR=NS_LOCAL,
        MASTER_PORT=str(port),
    )
    pipe = subprocess.PIPE
    command = ["ip", "netns", "exec", ns, sys.executable, *argv]
    return subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True)


def run_two_hosts(argv: Sequence[str], port: int, timeout_s: float) -> list[tuple[int, str, str]]:
    """`python *argv` as rank 0 in the master's namespace and rank 1 in the peer's, over a
    fresh veth link; (returncode, stdout, stderr) of each, killed past `timeout_s`."""
    with veth_link() as link:
        procs = [
            start_rank_in(ns, rank, port, *argv)
            for rank, ns in enumerate((link.local_ns, link.peer_ns))
        ]
        results = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            results.append((proc.returncode, out, err))
        return results


def _in_namespace(ns: str, code: str) -> str:
    result = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.timeout(90)
def test_route_inside_a_namespace_names_its_veth() -> None:
    code = (
        "from phalanx.ground.netif import route_interface as r; "
        f"print(r({NS_PEER!r}), r({NS_LOCAL!r}), r('127.0.0.1'))"
    )
    with veth_link() as link:
        assert _in_namespace(link.local_ns, code).split() == [link.local_if] * 2 + ["None"]
        # From the other side the same link is the other end of the pair.
        code_back = f"from phalanx.ground.netif import route_interface as r; print(r({NS_LOCAL!r}))"
        assert _in_namespace(link.peer_ns, code_back) == link.peer_if


@pytest.mark.timeout(90)
def test_address_off_every_link_has_no_route_in_a_namespace() -> None:
    # The namespace has no default route: nothing outside the /30 is reachable.
    code = "from phalanx.ground.netif import route_interface as r; print(r('10.99.0.1'))"
    with veth_link() as link:
        assert _in_namespace(link.local_ns, code) == "None"


@pytest.mark.timeout(90)
def test_secondary_address_is_found_through_the_route_table() -> None:
    # SIOCGIFADDR sees only an interface's first IPv4 address; a second one, on its
    # own /30, must still map to the veth (through /proc/net/route).
    code = "from phalanx.ground.netif import route_interface as r; print(r('10.213.8.2'))"
    with veth_link() as link:
        _ip("-n", link.local_ns, "addr", "add", "10.213.8.1/30", "dev", link.local_if)
        assert _in_namespace(link.local_ns, code) == link.local_if
