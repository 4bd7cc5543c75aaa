"""A small client of torch's TCPStore wire protocol, with no torch import.

The launcher (which must never import torch) uses it to prove that a port is
really a torch store and not merely open, to assign node ranks at rendezvous,
and to wait for the master's next attempt; the workers use it to ask who
already holds rank 0's store. It speaks the subset of the protocol those need
(store_wire.py), and is tested against a real `torch.distributed.TCPStore`.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable, Sequence

from phalanx.ground.store_wire import I64, MAGIC, READY, U32, U64, Query, sized

__all__ = ["NotAStoreError", "StoreClient", "Unreachable"]

_POLL_S = 0.05
# How much of a foreign program's greeting to show, and how long to wait for the rest of it.
_GREETING_BYTES = 60
_GREETING_WAIT_S = 0.2


class NotAStoreError(OSError):
    """Something answered on the port, but not as a torch store does."""


class Unreachable(OSError):
    """No connection reached the host at all (as opposed to one refused: a refusal comes
    from a host that is there, with nothing listening on the port yet). `kind` says how:
    "no route to host", "network is unreachable", "refused by a firewall rule", "timed out"."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


# The connect errors that mean the host was never reached, in the kernel's words.
_UNREACHABLE = {
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network is unreachable",
    errno.EACCES: "refused by a firewall rule",
    errno.EPERM: "refused by a firewall rule",
}


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection, or `Unreachable` when the host itself cannot be reached."""
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError as exc:  # no answer at all to the SYN: dropped on the way
        raise Unreachable("timed out") from exc
    except OSError as exc:
        kind = _UNREACHABLE.get(exc.errno or 0)
        if kind is None:
            raise
        raise Unreachable(kind) from exc


def _key(key: str) -> bytes:
    # torch's client puts "/" before every key (TCPStore::keyPrefix_); so do we, so that
    # both see one key space.
    return sized(("/" + key).encode())


class StoreClient:
    """One validated connection to a TCPStore; every call blocks for at most `timeout_s`."""

    def __init__(
        self, host: str, port: int, timeout_s: float, connect_timeout_s: float | None = None
    ) -> None:
        """Connect (within `connect_timeout_s`, default `timeout_s`), validate and ping:
        raises `Unreachable` when the host cannot be reached, another OSError when nothing
        answers in time (ConnectionRefusedError: nothing listens), and `NotAStoreError`
        when the answer is not a store's."""
        self.address = f"{host}:{port}"
        connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self._sock = _connect(host, port, connect_s)
        try:
            self._sock.settimeout(timeout_s)
            nonce = int.from_bytes(os.urandom(4), "little")
            self._sock.sendall(
                bytes([Query.VALIDATE]) + U32.pack(MAGIC) + bytes([Query.PING]) + U32.pack(nonce)
            )
            reply = self._recv_exactly(4, handshake=True)
            if U32.unpack(reply)[0] != nonce:
                raise NotAStoreError(f"it answered {self._more(reply)!r} to the store handshake")
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _more(self, start: bytes) -> bytes:
        """`start` and whatever else the peer already sent: enough to recognise a program."""
        self._sock.settimeout(_GREETING_WAIT_S)
        try:
            return start + self._sock.recv(_GREETING_BYTES)
        except OSError:
            return start

    def _recv_exactly(self, size: int, handshake: bool = False) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self._sock.recv(size - len(data))
            if not chunk:
                what = "closed the connection at the store handshake" if handshake else "closed"
                raise NotAStoreError(
                    f"{self.address} {what}" + (f" after {data!r}" if data else "")
                )
            data += chunk
        return data

    def add(self, key: str, amount: int) -> int:
        """Add to the counter `key` (0 when new) and return its new value."""
        self._sock.sendall(bytes([Query.ADD]) + _key(key) + I64.pack(amount))
        return int(I64.unpack(self._recv_exactly(8))[0])

    def set(self, key: str, value: bytes) -> None:
        self._sock.sendall(bytes([Query.SET]) + _key(key) + sized(value))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: `desired` replaces `expected` (b"": absent) atomically; the
        value `key` holds afterwards (the current one when it did not match)."""
        self._sock.sendall(
            bytes([Query.COMPARE_SET]) + _key(key) + sized(expected) + sized(desired)
        )
        (size,) = U64.unpack(self._recv_exactly(8))
        return self._recv_exactly(size) if size else b""

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists, without waiting."""
        request = U64.pack(len(keys)) + b"".join(_key(k) for k in keys)
        self._sock.sendall(bytes([Query.CHECK]) + request)
        return self._recv_exactly(1) == READY

    def get(self, key: str) -> bytes:
        """The value of an existing `key` (check first: a missing key is the server's error)."""
        self._sock.sendall(bytes([Query.GET]) + _key(key))
        (size,) = U64.unpack(self._recv_exactly(8))
        return self._recv_exactly(size) if size else b""

    def wait_for_count(
        self,
        key: str,
        count: int | Callable[[], int],
        timeout_s: float,
        cancelled: Callable[[], bool],
    ) -> bool:
        """Poll until counter `key` reaches `count` (True), or time runs out or `cancelled()`;
        a callable `count` is asked again at each poll (a target that moves)."""
        deadline = time.monotonic() + timeout_s
        while self.add(key, 0) < (count() if callable(count) else count):
            if time.monotonic() >= deadline or cancelled():
                return False
            time.sleep(_POLL_S)
        return True

    def wait_for(
        self, keys: Sequence[str], timeout_s: float, cancelled: Callable[[], bool] = lambda: False
    ) -> bool:
        """Poll until every key exists (True), or `timeout_s` passes or `cancelled()` (False).

        Polling rather than the protocol's WAIT keeps the connection usable after a
        timeout: a cancelled WAIT leaves a reply in flight.
        """
        deadline = time.monotonic() + timeout_s
        while not self.check(keys):
            if time.monotonic() >= deadline or cancelled():
                return False
            time.sleep(_POLL_S)
        return True
