"""TCP ports and addresses for a master: a free port, and a socket on one of this host's
own addresses. The launcher, the runtime's rank 0, the tests and the benchmarks share them.

No torch import here: the launcher uses it and must start fast without torch.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import socket

__all__ = [
    "AddressUnresolved",
    "NotThisHost",
    "PortInUse",
    "bind_own_address",
    "free_port",
    "leads_back_here",
]


def free_port(avoid: int | None = None) -> int:
    """A TCP port nobody listens on now, different from `avoid`.

    Binding the wildcard address (as rank 0's TCP store will) proves the port is
    free on every interface. A restart avoids the previous port, whose sockets
    may still sit in TIME_WAIT.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port


class AddressUnresolved(OSError):
    """The host name does not resolve (the resolver's message is the text)."""


class PortInUse(OSError):
    """One of the host's addresses is ours, but something already listens on the port."""


class NotThisHost(OSError):
    """The host resolves, but to no address of this machine: `resolved` lists what it named."""

    def __init__(self, resolved: list[str], reason: str) -> None:
        super().__init__(reason)
        self.resolved = resolved
        self.reason = reason


def bind_own_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to `host`:`port`, where `host` must name an
    address of this machine.

    The kernel is the judge of "an address of this host": binding a foreign address
    fails at once (EADDRNOTAVAIL), where a store told to serve it would only find out
    when its first client times out. Port 0 asks about the address alone.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AddressUnresolved(str(exc)) from exc
    last: OSError | None = None
    for family, kind, proto, _name, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            # As torch's store does: a port left in TIME_WAIT by an earlier job is reusable.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(str(exc)) from exc
    resolved = list(dict.fromkeys(str(info[4][0]) for info in infos))
    raise NotThisHost(resolved, last.strerror or str(last) if last else "no address")


def leads_back_here(host: str, port: int, timeout_s: float) -> bool:
    """Whether a connection to `host`:`port` arrives at this host's `port` (a NAT rule or a
    Kubernetes Service in front of it): a foreign address that is forwarded here works.

    A listener on every interface takes the connection, and a random token sent through
    it must come out there: a proxy or another machine that answers does not count.
    False also when nothing answers within `timeout_s`; True when the port is taken
    here (its owner is another question, asked where the store is hosted).
    """
    token = secrets.token_bytes(16)
    try:
        listener = socket.create_server(("", port), reuse_port=False)
    except OSError:
        return True
    with listener:
        listener.settimeout(timeout_s)
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as client:
                client.sendall(token)
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(timeout_s)
                    return _read_exactly(conn, len(token)) == token
        except OSError:  # refused, unreachable, or nothing came through in time
            return False


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while len(data) < size and (chunk := conn.recv(size - len(data))):
            data += chunk
    return data
