"""Which local network interface reaches a given host.

Gloo advertises to its peers the address of the interface it binds. Left to
itself it takes the address the hostname resolves to, which on many hosts
(Debian's `127.0.1.1 myhost`, containers with `127.0.0.1 myhost`) is loopback:
the peers on other machines then dial their own loopback and a 2-host job dies
with "Connection refused". Pointing `GLOO_SOCKET_IFNAME` at the interface that
routes to the master fixes that: this module finds that interface, and holds
the one policy (`choose_gloo_ifname`) that both the launcher and every worker's
`phalanx.init()` follow, so they never decide differently for the same job.

No torch import here: the launcher uses it and must start fast without torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "USER_IFNAME_VARS",
    "GlooIfname",
    "choose_gloo_ifname",
    "interface_for_address",
    "ipv4_address",
    "is_local_address",
    "is_loopback",
    "local_addr_ifname",
    "route_interface",
    "source_address",
]

# From <linux/sockios.h>: read the primary IPv4 address of an interface.
_SIOCGIFADDR = 0x8915
# Any port works: a UDP connect only picks a route and a source address; no packet leaves.
_PROBE_PORT = 9
_PROC_ROUTE = Path("/proc/net/route")
_PROC_IF_INET6 = Path("/proc/net/if_inet6")
# The variables through which users pin the interface themselves; if either is set we keep
# out. NCCL_SOCKET_IFNAME counts too: its value can be a prefix or "^exclusion" that gloo
# does not understand, so we cannot copy it, but it says the user manages the network.
USER_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _resolve(host: str) -> list[IPAddress]:
    """Every address `host` resolves to, IPv4 first; empty when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    found: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        # IPv6 link-local results carry a "%scope" suffix that ip_address rejects.
        addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if addr not in found:
            found.append(addr)
    return sorted(found, key=lambda a: a.version)


def is_loopback(host: str) -> bool:
    """True when `host` resolves only to loopback addresses (127.0.0.0/8, ::1).

    A name that does not resolve is not loopback: we cannot tell, and treating
    it as local would hide a typo in MASTER_ADDR behind a single-node setup.
    """
    addrs = _resolve(host)
    return bool(addrs) and all(a.is_loopback for a in addrs)


def is_local_address(host: str) -> bool:
    """True when `host` resolves to an address of this machine: one we can bind.

    Binding asks the kernel itself, so aliases, IPv6 and the whole of
    127.0.0.0/8 count, and an address routed here by NAT does not.
    """
    for addr in _resolve(host):
        family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((str(addr), 0))
                return True
            except OSError:
                continue
    return False


def source_address(host: str) -> str | None:
    """The local address the kernel would send from to reach `host`, or None.

    Connecting a UDP socket runs the routing decision (policy rules included)
    without sending anything, and `getsockname` then tells the chosen source.
    """
    for addr in _resolve(host):
        family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((str(addr), _PROBE_PORT))
                return str(probe.getsockname()[0]).split("%", 1)[0]
        except OSError:  # no route for this family ("Network is unreachable"): try the next
            continue
    return None


def ipv4_address(name: str) -> str | None:
    """The primary IPv4 address of interface `name`, or None when it has none."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: the interface has no IPv4 address
            return None
    # struct ifreq: 16 bytes of name, then a sockaddr_in whose address starts at byte 4.
    return socket.inet_ntoa(reply[20:24])


def _ipv6_interfaces() -> dict[IPAddress, str]:
    """IPv6 address -> interface name, from /proc/net/if_inet6 (empty off Linux)."""
    table: dict[IPAddress, str] = {}
    with contextlib.suppress(OSError):
        for line in _PROC_IF_INET6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                table[ipaddress.IPv6Address(int(fields[0], 16))] = fields[5]
    return table


def interface_for_address(ip: str) -> str | None:
    """The name of the local interface that holds address `ip`, or None."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 6:
        return _ipv6_interfaces().get(addr)
    for _index, name in socket.if_nameindex():
        if ipv4_address(name) == ip:
            return name
    return None


def _proc_ipv4(field: str) -> int:
    """An address from /proc/net/route: the kernel prints the network-order word as a
    host-order integer, so packing it back natively restores the network bytes."""
    return int.from_bytes(struct.pack("=I", int(field, 16)), "big")


def _route_table_interface(ip: str) -> str | None:
    """Longest-prefix match of IPv4 `ip` in /proc/net/route.

    The fallback for a source address that is not an interface's primary one
    (an alias added with `ip addr add`), which SIOCGIFADDR cannot see.
    """
    target = int(ipaddress.IPv4Address(ip))
    best: tuple[int, str] | None = None
    with contextlib.suppress(OSError):
        for line in _PROC_ROUTE.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            dest, mask = _proc_ipv4(fields[1]), _proc_ipv4(fields[7])
            if target & mask == dest and (best is None or mask > best[0]):
                best = (mask, fields[0])
    return best[1] if best else None


def route_interface(host: str) -> str | None:
    """The local interface the kernel would use to reach `host`.

    None when that route is loopback (the host is this machine's loopback,
    so loopback is right) or when no route or interface can be found.
    """
    source = source_address(host)
    if source is None or ipaddress.ip_address(source).is_loopback:
        return None
    name = interface_for_address(source)
    if name is None and ipaddress.ip_address(source).version == 4:
        target = next((a for a in _resolve(host) if a.version == 4), None)
        name = _route_table_interface(str(target)) if target is not None else None
    return None if name == "lo" else name


@dataclass(frozen=True)
class GlooIfname:
    """What to do about GLOO_SOCKET_IFNAME for one job, and the line that says why."""

    name: str | None
    """The interface to export; None leaves the environment as it is."""
    note: str | None
    """One line for the log; None when there is nothing worth saying."""
    warning: bool = False
    """`note` warns: peers on other hosts may be unable to reach this one."""


def choose_gloo_ifname(
    master_addr: str, world_size: int, local_world_size: int, environ: Mapping[str, str]
) -> GlooIfname:
    """The GLOO_SOCKET_IFNAME policy of the launcher and of every worker alike.

    Nothing to choose for a world of one, or when every rank is on this host
    and the master is loopback (loopback is then right). Otherwise a user's
    non-empty GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME wins (gloo reads an
    empty value as unset, so that is no choice); else the interface that
    routes to the master. When none does, a job that spans hosts is warned.
    """
    spans_hosts = world_size > local_world_size
    if world_size <= 1 or (not spans_hosts and is_loopback(master_addr)):
        return GlooIfname(None, None)
    chosen = [f"{var}={environ[var]}" for var in USER_IFNAME_VARS if environ.get(var)]
    if chosen:
        return GlooIfname(None, f"using the interface set in the environment ({', '.join(chosen)})")
    name = route_interface(master_addr)
    if name is not None:
        return GlooIfname(
            name,
            f"GLOO_SOCKET_IFNAME={name} (the interface that routes to MASTER_ADDR={master_addr}); "
            "export GLOO_SOCKET_IFNAME to choose another",
        )
    if not spans_hosts:  # one host: gloo's own choice reaches every peer
        return GlooIfname(None, None)
    return GlooIfname(
        None,
        f"no non-loopback interface routes to MASTER_ADDR={master_addr} although the job spans "
        "hosts; leaving GLOO_SOCKET_IFNAME unset — if peers fail to connect, export "
        "GLOO_SOCKET_IFNAME=<interface>",
        warning=True,
    )


def local_addr_ifname(local_addr: str, environ: Mapping[str, str]) -> GlooIfname:
    """The GLOO_SOCKET_IFNAME policy under `phalanx launch --local-addr`: the interface
    that holds that address (the user's own GLOO/NCCL_SOCKET_IFNAME still wins)."""
    chosen = [f"{var}={environ[var]}" for var in USER_IFNAME_VARS if environ.get(var)]
    if chosen:
        return GlooIfname(None, f"using the interface set in the environment ({', '.join(chosen)})")
    addrs = _resolve(local_addr)
    name = interface_for_address(str(addrs[0])) if addrs else None
    if name is None or name == "lo":
        return GlooIfname(None, None)
    return GlooIfname(
        name,
        f"GLOO_SOCKET_IFNAME={name} (the interface of --local-addr {local_addr}); "
        "export GLOO_SOCKET_IFNAME to choose another",
    )
