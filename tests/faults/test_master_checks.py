"""A wrong master address fails at once, and only a real store counts as reachable (issue 12,
item 7).

Node 0 used to accept a --master-addr that is not its own and hang for the whole
init timeout; a node other than 0 used to accept any open port as the master and
leave its workers to fail there with a C++ stack trace per retry.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launchkit import SCRIPTS, launch

pytestmark = pytest.mark.faults

# TEST-NET-3 (RFC 5737): documentation only, never an address of this host.
NOT_OURS = "203.0.113.7"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", ["--nnodes 2 --node-rank 0 --master-port 29511", "--nnodes 1"])
def test_node_0_refuses_a_master_address_that_is_not_its_own(tmp_path: Path, nodes: str) -> None:
    started = time.monotonic()
    result = launch(f"{nodes} --master-addr {NOT_OURS}", SCRIPTS / "env_dump.py", tmp_path)
    assert time.monotonic() - started < 15  # at once, not after an init timeout
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"the master address {NOT_OURS}" in result.stderr
    assert "is not an address of this host" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no worker was started


class _Impostor:
    """A TCP server on 127.0.0.1 that is not a store: it greets like sshd, or says nothing."""

    def __init__(self, greeting: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self._greeting = greeting
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._held.append(conn)
            if self._greeting:
                conn.sendall(self._greeting)

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture(params=[b"SSH-2.0-OpenSSH_9.6\r\n", b""], ids=["greets", "silent"])
def impostor(request: pytest.FixtureRequest) -> Iterator[_Impostor]:
    server = _Impostor(request.param)
    yield server
    server.close()


@pytest.mark.timeout(60)
def test_a_port_that_is_not_a_store_is_not_the_master(tmp_path: Path, impostor: _Impostor) -> None:
    flags = (
        f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {impostor.port} "
        "--rdzv-timeout 4"
    )
    started = time.monotonic()
    result = launch(flags, SCRIPTS / "env_dump.py", tmp_path)
    took = time.monotonic() - started
    assert result.returncode == 203  # infrastructure: the master is not there (a retry may find it)
    assert took < 4 + 10, f"took {took:.0f}s with --rdzv-timeout 4"
    if impostor._greeting:
        assert "something other than a torch store answers at 127.0.0.1" in result.stderr
        assert "SSH-2.0" in result.stderr
    else:
        assert "it accepted the connection but did not answer the store handshake" in (
            result.stderr
        )
    assert "— check --master-addr" in result.stderr
    assert "socket.cpp" not in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no worker was started
