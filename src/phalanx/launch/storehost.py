"""The job's rendezvous store, hosted by the launcher that owns the master address.

The launcher binds the store's listening socket itself, to one address: the
master address on one node (127.0.0.1 unless told otherwise), the address the
other nodes dial in a multi-node job. torch's own TCPStore would listen on
every interface, IPv4 and IPv6, where anyone on the network can read and
write its keys. The socket lives as long as the launcher, so the port never
changes between restarts and never sits in TIME_WAIT.

The store speaks torch's TCPStore protocol but is served by the launcher itself,
in a thread (ground/storeserver.py): the launcher imports no torch, and a
helper process that imported it (to run torch's own server) put a second torch
import before every worker's `init` (benchmarks/startup.py). Each attempt gets
a fresh server, so no key of a failed attempt leaks into the next (as torchrun
creates a new store per attempt); clients that knock between two attempts wait
in the socket's backlog. Workers reach it as torchrun's workers reach
torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE).
"""

from __future__ import annotations

import errno
import socket

from phalanx.errors import ConfigurationError, PortTakenError
from phalanx.ground.ports import AddressUnresolved, NotThisHost, PortInUse, bind_own_address
from phalanx.ground.store_keys import ATTEMPT_KEY
from phalanx.ground.storeserver import StoreServer

__all__ = ["StoreHost", "bind_store_socket"]

_BACKLOG = 4096


def bind_store_socket(host: str, port: int, port_flag: str, free_hint: bool) -> socket.socket:
    """A listening socket on `host`'s own address, or a one-line error that says what to fix.

    `port_flag` names the flag that set the port (for the message); `free_hint`
    adds that leaving it unset picks a free one.
    """
    try:
        sock = bind_own_address(host, port)
    except AddressUnresolved as exc:
        raise ConfigurationError(
            f"the master address {host!r} does not resolve ({exc}) — pass this host's "
            "hostname or IP address"
        ) from exc
    except PortInUse as exc:
        raise PortTakenError(_port_taken(host, port, port_flag, free_hint)) from exc
    except NotThisHost as exc:
        resolved = ", ".join(exc.resolved)
        shown = host if resolved == host else f"{host} ({resolved})"
        raise ConfigurationError(
            f"the master address {shown} is not an address of this host ({exc.reason}), but "
            "this node hosts the store — pass this host's own address as --master-addr on "
            "every node (behind NAT or a Kubernetes Service, add --local-addr <this host's "
            "address>)"
        ) from exc
    try:
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:  # bound beside another's socket that listens first
            raise PortTakenError(_port_taken(host, port, port_flag, free_hint)) from exc
        raise
    return sock


def _port_taken(host: str, port: int, port_flag: str, free_hint: bool) -> str:
    hint = " (or leave it unset to pick a free one)" if free_hint else " on every node"
    return (
        f"port {port} is taken on {host} — another job is using it; pass another {port_flag}{hint}"
    )


class StoreHost:
    """This node's store socket, and the server that serves the current attempt from it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.address = str(sock.getsockname()[0])
        self.port = int(sock.getsockname()[1])
        self._server: StoreServer | None = None

    def open_attempt(self, attempt: int) -> None:
        """Serve attempt `attempt` with a fresh store; call it before starting the workers.

        The attempt's number is its first key: the other nodes' launchers wait for it
        before they start their workers (a store of an older attempt must not be joined)."""
        self.close_attempt()
        # Stored as torch's client names it: with the "/" that every client puts first.
        self._server = StoreServer(self.sock, {f"/{ATTEMPT_KEY}": str(attempt).encode()})
        self._server.serve()

    def close_attempt(self) -> None:
        """Stop serving this attempt: its clients' connections close, its keys go."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def close(self) -> None:
        self.close_attempt()
        self.sock.close()
