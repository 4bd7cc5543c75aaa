"""The launcher's torch-free store server, held to torch's own: the same requests from torch's
C++ client (in another process, as the workers are) get the same answers from both, and a
client that breaks the protocol loses its own connection and nothing else."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from phalanx.ground.storeclient import StoreClient
from phalanx.ground.storeserver import StoreServer

_CLIENT_S = 60


def _script(port: int, role: str) -> list[object]:
    """What torch's client gets from the store at `port`: run in a child process."""
    import threading

    import torch.distributed as dist

    def client() -> Any:  # torch's stubs lack barrier, append, multi_set and bytes values
        return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=20))

    store, out = client(), []

    def note(value: object) -> None:
        out.append(value.decode() if isinstance(value, bytes) else value)

    if role == "pop":  # the other role pushes and joins the barrier
        store.set("popping", b"")
        note(store.queue_pop("jobs"))  # blocks until pushed (or finds it pushed)
        store.barrier("gate", 2)
        note("past the barrier")
        return out
    if role == "push":
        store.wait(["popping"])
        time.sleep(0.2)  # most often the pop is parked by now; the answers are the same if not
        store.queue_push("jobs", b"work")
        store.barrier("gate", 2)
        note("past the barrier")
        return out
    store.set("a", b"1")
    note(store.get("a"))
    note([store.add("n", 5), store.add("n", -7), store.add("n", 0)])
    note(store.compare_set("a", b"1", b"2"))  # matched
    note(store.compare_set("a", b"1", b"3"))  # not matched: the current value
    note(store.compare_set("new", b"", b"v"))  # absent, empty expectation: set
    note(store.compare_set("absent", b"x", b"y"))  # absent: torch answers the expectation
    note([store.check(["a", "new"]), store.check(["absent"]), store.num_keys()])
    store.append("a", b"+tail")
    store.append("fresh", b"first")
    note([store.get("a"), store.get("fresh")])
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    note(store.multi_get(["m1", "m2", "a"]))
    note([store.delete_key("m1"), store.delete_key("m1"), store.check(["m1"])])
    note(sorted(store.list_keys()))
    try:
        store.wait(["never"], timedelta(seconds=0.2))
        note("no timeout")
    except dist.DistStoreError:
        note("timed out")
    store.set("after a timeout", b"still usable")
    note(store.get("after a timeout"))
    other = client()
    threading.Timer(0.2, lambda: other.set("late", b"came")).start()
    store.wait(["late"])  # parked, then woken by the other client's set
    note(store.get("late"))
    store.queue_push("q", b"one")
    store.queue_push("q", b"two")
    note([store.queue_len("q"), store.queue_pop("q"), store.queue_len("q")])
    store.barrier("alone", 1)
    note(store.get("alone"))
    note(store.num_keys())
    return out


def _run(port: int, role: str = "all") -> subprocess.Popen[str]:
    code = "import sys, json; from tests.unit.test_storeserver import _script; "
    code += f"print(json.dumps(_script({port}, {role!r}), default=bytes.decode))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _answers(procs: list[subprocess.Popen[str]]) -> list[Any]:
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=_CLIENT_S)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@contextmanager
def _ours() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = StoreServer(listener)
    server.serve()
    try:
        yield int(listener.getsockname()[1])
    finally:
        server.stop()
        listener.close()


@contextmanager
def _torchs() -> Iterator[int]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=20),
                          wait_for_workers=False)  # fmt: skip
    yield int(store.port)
    del store


@pytest.mark.timeout(180)
def test_torch_client_gets_the_answers_torchs_server_gives() -> None:
    answers = []
    for host in (_torchs, _ours):
        with host() as port:
            answers.append(
                _answers([_run(port)]) + _answers([_run(port, "pop"), _run(port, "push")])
            )
    assert answers[0] == answers[1]
    assert answers[1][0][0] == "1" and answers[1][1] == ["work", "past the barrier"]


@contextmanager
def _raw(port: int) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def _closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def _validate() -> bytes:
    return struct.pack("=BI", 0, 0x3C85F7CE)


@pytest.mark.timeout(60)
def test_a_client_that_breaks_the_protocol_loses_only_its_connection() -> None:
    with _ours() as port, StoreClient("127.0.0.1", port, 10) as good:
        good.set("kept", b"yes")
        with _raw(port) as stranger:  # an HTTP request instead of the handshake
            stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert _closed(stranger)
        with _raw(port) as liar:  # the handshake with the wrong magic
            liar.sendall(struct.pack("=BI", 0, 1234))
            assert _closed(liar)
        with _raw(port) as unknown:  # a command torch does not have
            unknown.sendall(_validate() + bytes([99]))
            assert _closed(unknown)
        with _raw(port) as greedy:  # a key longer than torch's server allows
            greedy.sendall(_validate() + bytes([3]) + struct.pack("=Q", 1 << 40))
            assert _closed(greedy)
        with _raw(port) as bad_add:  # ADD to a value that is not a number
            key = b"/kept"
            request = bytes([4]) + struct.pack("=Q", len(key)) + key + struct.pack("=q", 1)
            bad_add.sendall(_validate() + request)
            assert _closed(bad_add)
        assert good.get("kept") == b"yes" and good.add("n", 2) == 2


@pytest.mark.timeout(60)
def test_a_request_that_arrives_a_byte_at_a_time_is_answered_once_whole() -> None:
    with _ours() as port, StoreClient("127.0.0.1", port, 10) as good, _raw(port) as slow:
        slow.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = b"/counter"
        request = _validate() + bytes([4]) + struct.pack("=Q", len(key)) + key
        for byte in request + struct.pack("=q", 41):
            slow.sendall(bytes([byte]))
            time.sleep(0.001)
        assert struct.unpack("=q", slow.recv(8))[0] == 41
        assert good.add("counter", 1) == 42


@pytest.mark.timeout(60)
def test_a_new_attempt_starts_from_its_own_keys_on_the_same_port() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    first = StoreServer(listener, {"/phalanx/attempt": b"0"})
    first.serve()
    old = StoreClient("127.0.0.1", port, 10)
    old.set("stale", b"from attempt 0")
    first.stop()
    with pytest.raises(OSError):  # the old attempt's clients are cut off
        old.get("stale")
    old.close()
    second = StoreServer(listener, {"/phalanx/attempt": b"1"})
    second.serve()
    try:
        with StoreClient("127.0.0.1", port, 10) as client:
            assert client.get("phalanx/attempt") == b"1" and not client.check(["stale"])
    finally:
        second.stop()
        listener.close()


@pytest.mark.timeout(60)
def test_a_client_that_never_reads_its_replies_is_dropped_not_served_forever() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    server = StoreServer(listener)
    server.serve()
    port = int(listener.getsockname()[1])
    try:
        with StoreClient("127.0.0.1", port, 10) as good, _raw(port) as greedy:
            good.set("big", b"x" * (8 * 1024 * 1024))
            assert good.check(["big"])  # answered after the set on its connection: stored
            key = b"/big"
            get = bytes([3]) + struct.pack("=Q", len(key)) + key
            greedy.sendall(_validate() + get * 12)  # 96 MiB of replies asked for, none read
            deadline = time.monotonic() + 30
            while server.connections > 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # the event: the server lets the greedy one go
            assert server.connections == 1
            received = 0
            while chunk := greedy.recv(1 << 20):  # what the kernel held, then the end
                received += len(chunk)
            assert received < 12 * 8 * 1024 * 1024
            assert good.get("big") == b"x" * (8 * 1024 * 1024)
    finally:
        server.stop()
        listener.close()
