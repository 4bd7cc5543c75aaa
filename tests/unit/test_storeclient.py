"""The launcher's torch-free store client, against a real torch TCPStore."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from phalanx.ground.storeclient import NotAStoreError, StoreClient


@pytest.fixture
def store() -> Iterator[object]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    yield server
    del server


def test_one_key_space_with_torch_clients(store: object) -> None:
    port = store.port  # type: ignore[attr-defined]
    with StoreClient("127.0.0.1", port, 5) as client:
        assert client.add("n", 2) == 2
        assert client.add("n", 3) == 5
        assert store.get("n") == b"5"  # type: ignore[attr-defined]
        client.set("ours", b"value")
        assert store.get("ours") == b"value"  # type: ignore[attr-defined]
        store.set("theirs", "torch")  # type: ignore[attr-defined]
        assert client.check(["theirs", "ours"]) and not client.check(["theirs", "nope"])
        assert client.get("theirs") == b"torch"
        assert client.wait_for(["theirs"], 1) and not client.wait_for(["never"], 0.2)
        assert not client.wait_for_count("n", 6, 0.2, lambda: False)
        assert client.wait_for_count("n", 5, 0.2, lambda: False)


def test_compare_set_as_torch_does(store: object) -> None:
    port = store.port  # type: ignore[attr-defined]
    with StoreClient("127.0.0.1", port, 5) as client:
        assert client.compare_set("k", b"", b"first") == b"first"  # absent: set
        assert client.compare_set("k", b"", b"second") == b"first"  # present: kept
        assert client.compare_set("k", b"first", b"third") == b"third"  # matched: swapped
        assert store.get("k") == b"third"  # type: ignore[attr-defined]
        assert client.compare_set("gone", b"x", b"y") == b"x"  # torch: absent, not expected
        assert not client.check(["gone"])


class _Listener:
    """A TCP server that is not a store: it sends `greeting` (if any) to each client, then
    closes the connection if `hang_up`, else holds it open and says nothing more."""

    def __init__(self, greeting: bytes, hang_up: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, args=(greeting, hang_up), daemon=True).start()

    def _serve(self, greeting: bytes, hang_up: bool) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(greeting)
            if hang_up:
                conn.recv(64)  # read the handshake first: closing on unread data would reset
                conn.close()
            else:
                self._held.append(conn)


def test_a_silent_listener_times_out() -> None:
    listener = _Listener(b"", hang_up=False)
    with pytest.raises(TimeoutError):
        StoreClient("127.0.0.1", listener.port, 0.3)
    listener.sock.close()


@pytest.mark.parametrize(
    ("greeting", "hang_up", "said"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", False, "answered b'SSH-2.0-OpenSSH_9.6\\r\\n'"),
        (b"", True, "closed the connection at the store handshake"),
    ],
)
def test_a_program_that_is_not_a_store_is_told_apart(
    greeting: bytes, hang_up: bool, said: str
) -> None:
    listener = _Listener(greeting, hang_up)
    with pytest.raises(NotAStoreError) as caught:
        StoreClient("127.0.0.1", listener.port, 5)
    assert said in str(caught.value)
    listener.sock.close()
