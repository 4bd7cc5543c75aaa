"""The job's rendezvous store, hosted by the launcher that owns the master address.

The launcher binds the store's listening socket itself, to one address: the
master address on one node (127.0.0.1 unless told otherwise), the address the
other nodes dial in a multi-node job. torch's own TCPStore would listen on
every interface, IPv4 and IPv6, where anyone on the network can read and
write its keys. The socket lives as long as the launcher, so the port never
changes between restarts and never sits in TIME_WAIT.

The store itself is torch's TCPStore, served from that socket
(`master_listen_fd`) by a helper process: the launcher imports no torch. Each
attempt gets a fresh helper, so no key of a failed attempt leaks into the
next (as torchrun creates a new store per attempt). The helper is started with
the attempt, before its workers: it imports torch while they do, so the store
is serving when their `init` first knocks (started at the first knock instead,
its import came after theirs, and every worker's `init` waited for it:
benchmarks/startup.py). Workers reach it as torchrun's workers reach
torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE).
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from phalanx.errors import ConfigurationError, PortTakenError
from phalanx.ground.ports import AddressUnresolved, NotThisHost, PortInUse, bind_own_address
from phalanx.launch.lifeline import Lifeline
from phalanx.launch.procgroup import signal_group

__all__ = ["StoreHost", "bind_store_socket"]

_BACKLOG = 4096
_HELPER_EXIT_S = 2.0
_SERVE = "from phalanx.runtime.store import serve_agent_store; serve_agent_store()"


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
    """This node's store socket, and the helper that serves the current attempt from it."""

    def __init__(
        self,
        sock: socket.socket,
        lifeline: Lifeline,
        announce: Callable[[str], None],
        python: str = sys.executable,
    ) -> None:
        self.sock = sock
        self.address = str(sock.getsockname()[0])
        self.port = int(sock.getsockname()[1])
        self._lifeline = lifeline
        self._announce = announce
        self._python = python
        self._helper: subprocess.Popen[bytes] | None = None

    def open_attempt(self, attempt: int) -> None:
        """Serve attempt `attempt` with a fresh store; call it before starting the workers.

        Clients that connect before the helper serves wait in the socket's backlog."""
        self._helper = self._spawn_helper(attempt)

    def _spawn_helper(self, attempt: int) -> subprocess.Popen[bytes]:
        fd = self.sock.fileno()
        helper = subprocess.Popen(
            [self._python, "-c", _SERVE, str(fd), self.address, str(self.port), str(attempt)],
            pass_fds=(fd,),
            stdin=subprocess.PIPE,  # its lifeline: closed when the attempt or the launcher ends
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._lifeline.watch(helper.pid)
        threading.Thread(target=self._relay, args=(helper,), daemon=True).start()
        return helper

    def _relay(self, helper: subprocess.Popen[bytes]) -> None:
        """The helper's complaints (a failed torch import, say) as launcher messages."""
        assert helper.stderr is not None
        with helper.stderr:
            for line in helper.stderr:
                text = line.decode(errors="replace").rstrip()
                if text:
                    self._announce(f"store: {text}")

    def close_attempt(self) -> None:
        """Stop serving this attempt: its clients are gone, and its keys go with the helper."""
        helper, self._helper = self._helper, None
        if helper is None:
            return
        assert helper.stdin is not None
        with contextlib.suppress(OSError):
            helper.stdin.close()
        try:
            helper.wait(timeout=_HELPER_EXIT_S)
        except subprocess.TimeoutExpired:
            signal_group(helper.pid, signal.SIGKILL)
            helper.wait()
        signal_group(helper.pid, signal.SIGKILL)  # anything it left in its group
        self._lifeline.release(helper.pid)

    def close(self) -> None:
        self.close_attempt()
        self.sock.close()
