"""torch's TCPStore, served in pure Python: the launcher hosts the job's store without torch.

The launcher must never import torch, and a helper process that did (to run
torch's own server) put a second torch import on the path to every worker's
`init` (benchmarks/startup.py). This server speaks the same wire protocol as
torch's libuv backend (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp),
so torch's C++ client, gloo's rendezvous and `StoreClient` all use it unchanged:

- a connection opens with VALIDATE and the magic number (anything else: closed);
- a request is a command byte, then native-endian fixed-size integers and
  byte strings prefixed by a u64 length;
- the same limits: keys up to 8 KiB, values up to 8 MiB, 128 Ki keys per request;
  and one of its own: a client that leaves 64 MiB of replies unread is dropped.

It runs in one thread of the launcher (`serve` / `stop`), on a listening socket
the launcher owns, with `selectors`: each request is answered whole or not at
all, a WAIT or BARRIER is parked until its keys arrive, and a client that sends
garbage (a stranger, a port scanner) loses its own connection and nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from phalanx.ground.store_wire import (
    I64,
    MAGIC,
    NOT_READY,
    READY,
    STOP_WAITING,
    U32,
    WAIT_CANCELED,
    Incomplete,
    Query,
    Reader,
    Refused,
    sized,
)

__all__ = ["StoreServer"]

_RECV_BYTES = 256 * 1024
_MAX_UNSENT = 64 * 1024 * 1024  # replies a client leaves unread: past this it is dropped
_ACCEPT_BACKOFF_S = 0.05  # out of file descriptors: let some close before accepting again
_INT64 = (-(2**63), 2**63 - 1)


def _counter(value: bytes | None, amount: int) -> int:
    """ADD's arithmetic: the stored decimal plus `amount`, in int64 as torch's stoll."""
    try:
        total = (int(value) if value is not None else 0) + amount
    except ValueError as exc:
        raise Refused(f"ADD to a value that is not a number: {(value or b'')[:40]!r}") from exc
    if not _INT64[0] <= total <= _INT64[1]:
        raise Refused("ADD past the int64 range")
    return total


class _Client:
    """One connection: its unread bytes, its unsent bytes, and what it waits for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.validated = False
        self.awaited = 0  # keys a parked WAIT or BARRIER still needs


class StoreServer:
    """One attempt's store, served from `listener` in a thread until `stop`.

    `initial` seeds keys as the server stores them (with torch's "/" prefix:
    `StoreClient` and torch's client both put it before every key)."""

    def __init__(self, listener: socket.socket, initial: dict[str, bytes] | None = None) -> None:
        self._listener = listener
        self._data: dict[bytes, bytes] = {k.encode(): v for k, v in (initial or {}).items()}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiting: dict[bytes, list[_Client]] = {}
        self._clients: dict[socket.socket, _Client] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._handlers: dict[int, Callable[[_Client, Reader], None]] = {
            Query.SET: self._set,
            Query.COMPARE_SET: self._compare_set,
            Query.GET: self._get,
            Query.ADD: self._add,
            Query.CHECK: self._check,
            Query.WAIT: self._wait,
            Query.GETNUMKEYS: self._num_keys,
            Query.DELETE_KEY: self._delete,
            Query.APPEND: self._append,
            Query.MULTI_GET: self._multi_get,
            Query.MULTI_SET: self._multi_set,
            Query.CANCEL_WAIT: self._cancel_wait,
            Query.PING: self._ping,
            Query.QUEUE_PUSH: self._queue_push,
            Query.QUEUE_POP: self._queue_pop,
            Query.QUEUE_LEN: self._queue_len,
            Query.LIST_KEYS: self._list_keys,
            Query.BARRIER: self._barrier,
        }

    @property
    def connections(self) -> int:
        """How many clients are connected now."""
        return len(self._clients)

    # ------------------------------------------------------------------ the thread

    def serve(self) -> None:
        """Start serving in a daemon thread (clients that came first wait in the backlog)."""
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="phalanx-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: every client's connection closes (its keys go with this object);
        the listening socket stays open, for the next attempt's server."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join()
        for client in list(self._clients.values()):
            client.sock.close()
        self._clients.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        client = self._clients.get(key.fileobj)  # type: ignore[call-overload]
                        if client is not None:
                            self._service(client, events)
        finally:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED: this one is lost, the server goes on
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # else the listener spins
                    time.sleep(_ACCEPT_BACKOFF_S)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(sock)
            self._clients[sock] = client
            self._selector.register(sock, selectors.EVENT_READ)

    def _service(self, client: _Client, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(client)
        if events & selectors.EVENT_READ and client.sock in self._clients:
            try:
                data = client.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(client)
                return
            client.inbox += data
            try:
                self._answer(client)
            except Refused:
                self._drop(client)

    # ------------------------------------------------------------------ framing

    def _answer(self, client: _Client) -> None:
        """Serve every whole request in the client's inbox, in order."""
        while client.inbox and client.sock in self._clients:
            reader = Reader(client.inbox)
            try:
                command = reader.take(1)[0]
                if not client.validated:
                    if command != Query.VALIDATE or reader.u32() != MAGIC:
                        raise Refused("the first request is not a store's handshake")
                    client.validated = True
                else:
                    handler = self._handlers.get(command)
                    if handler is None:
                        raise Refused(f"unknown command {command}")
                    handler(client, reader)
            except Incomplete:
                return
            del client.inbox[: reader.pos]

    def _send(self, client: _Client, data: bytes) -> None:
        if client.sock not in self._clients:
            return
        client.outbox += data
        if len(client.outbox) > _MAX_UNSENT:  # it asks and never reads: memory is not its
            self._drop(client)
            return
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(client)
            return
        del client.outbox[:sent]
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0)
        if self._selector.get_key(client.sock).events != wanted:
            self._selector.modify(client.sock, wanted)

    def _drop(self, client: _Client) -> None:
        if self._clients.pop(client.sock, None) is None:
            return
        self._forget_waits(client)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        client.sock.close()

    # ------------------------------------------------------------------ waiting

    def _ready(self, keys: list[bytes]) -> bool:
        return all(k in self._data or self._queues.get(k) for k in keys)

    def _park(self, client: _Client, keys: list[bytes]) -> None:
        client.awaited = len(keys)
        for key in keys:
            self._waiting.setdefault(key, []).append(client)

    def _wake(self, key: bytes, one: bool = False) -> None:
        """The clients parked on `key` that now have all their keys get STOP_WAITING (only
        the first of them when `one`: a queue's new item serves one popper)."""
        waiters = self._waiting.get(key)
        if not waiters:
            return
        for client in list(waiters):
            client.awaited -= 1
            if one:
                waiters.remove(client)
            if client.awaited == 0:
                self._send(client, STOP_WAITING)
                if one:
                    break
        if not one or not waiters:
            self._waiting.pop(key, None)

    def _forget_waits(self, client: _Client) -> None:
        client.awaited = 0
        for key in [k for k, waiters in self._waiting.items() if client in waiters]:
            waiters = [c for c in self._waiting[key] if c is not client]
            if waiters:
                self._waiting[key] = waiters
            else:
                del self._waiting[key]

    def _store(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    # ------------------------------------------------------------------ the requests

    def _set(self, client: _Client, reader: Reader) -> None:
        key, value = reader.key(), reader.payload()
        self._store(key, value)

    def _compare_set(self, client: _Client, reader: Reader) -> None:
        key, expected, desired = reader.key(), reader.payload(), reader.payload()
        current = self._data.get(key)
        if current is None:  # absent: set when `expected` is empty, as torch's server
            if not expected:
                self._data[key] = desired
            result = expected or desired
        else:
            if current == expected:
                self._data[key] = desired
            result = self._data[key]
        self._wake(key)
        self._send(client, sized(result))

    def _get(self, client: _Client, reader: Reader) -> None:
        self._send(client, sized(self._data.get(reader.key(), b"")))

    def _add(self, client: _Client, reader: Reader) -> None:
        key, amount = reader.key(), reader.i64()
        total = _counter(self._data.get(key), amount)
        self._store(key, str(total).encode())
        self._send(client, I64.pack(total))

    def _check(self, client: _Client, reader: Reader) -> None:
        self._send(client, READY if self._ready(reader.keys()) else NOT_READY)

    def _wait(self, client: _Client, reader: Reader) -> None:
        keys = reader.keys()
        if self._ready(keys):
            self._send(client, STOP_WAITING)
        else:
            self._park(client, [k for k in keys if k not in self._data])

    def _num_keys(self, client: _Client, reader: Reader) -> None:
        self._send(client, I64.pack(len(self._data)))

    def _delete(self, client: _Client, reader: Reader) -> None:
        deleted = self._data.pop(reader.key(), None) is not None
        self._send(client, I64.pack(int(deleted)))

    def _append(self, client: _Client, reader: Reader) -> None:
        key, value = reader.key(), reader.payload()
        self._store(key, self._data.get(key, b"") + value)

    def _multi_get(self, client: _Client, reader: Reader) -> None:
        keys = reader.keys()
        self._send(client, b"".join(sized(self._data.get(k, b"")) for k in keys))

    def _multi_set(self, client: _Client, reader: Reader) -> None:
        pairs = [(reader.key(), reader.payload()) for _ in range(reader.count())]
        for key, value in pairs:
            self._store(key, value)

    def _cancel_wait(self, client: _Client, reader: Reader) -> None:
        self._forget_waits(client)
        self._send(client, WAIT_CANCELED)

    def _ping(self, client: _Client, reader: Reader) -> None:
        self._send(client, U32.pack(reader.u32()))

    def _queue_push(self, client: _Client, reader: Reader) -> None:
        key, value = reader.key(), reader.payload()
        self._queues.setdefault(key, deque()).append(value)
        self._wake(key, one=True)

    def _queue_pop(self, client: _Client, reader: Reader) -> None:
        queue = self._queues.setdefault(reader.key(), deque())
        reply = I64.pack(len(queue))
        if queue:
            reply += sized(queue.popleft())
        self._send(client, reply)

    def _queue_len(self, client: _Client, reader: Reader) -> None:
        self._send(client, I64.pack(len(self._queues.get(reader.key(), ()))))

    def _list_keys(self, client: _Client, reader: Reader) -> None:
        keys = list(self._data)
        self._send(client, I64.pack(len(keys)) + b"".join(sized(k) for k in keys))

    def _barrier(self, client: _Client, reader: Reader) -> None:
        key, world_size = reader.key(), reader.i64()
        count = _counter(self._data.get(key), 1)
        self._data[key] = str(count).encode()  # the ones parked wake only when all are here
        if count >= world_size:
            self._wake(key)
            self._send(client, STOP_WAITING)
        else:
            self._park(client, [key])
