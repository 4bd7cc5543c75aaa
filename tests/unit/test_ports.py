"""phalanx.ground.ports: what the launcher and a hand-set rank 0 ask before hosting a store: is
the master address one of this host's, and, if not, does it lead back here anyway."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from phalanx.ground.ports import (
    NotThisHost,
    PortInUse,
    bind_own_address,
    free_port,
    leads_back_here,
)

# TEST-NET-3 (RFC 5737): documentation only, never an address of this host.
NOT_OURS = "203.0.113.7"


def test_an_address_of_this_host_binds() -> None:
    with bind_own_address("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_a_foreign_address_is_not_this_host() -> None:
    with pytest.raises(NotThisHost) as caught:
        bind_own_address(NOT_OURS, 0)
    assert caught.value.resolved == [NOT_OURS]


def test_a_port_someone_listens_on_is_in_use() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(PortInUse):
        bind_own_address("127.0.0.1", taken.getsockname()[1])


class _Relay:
    """A listener on [::1]:port (beside our IPv4 listener on the same port): forwards each
    connection to 127.0.0.1:port, as a NAT rule would, or swallows it, as a proxy would."""

    def __init__(self, port: int, forward: bool) -> None:
        self.sock = socket.create_server(("::1", port), family=socket.AF_INET6)
        self.port, self.forward = port, forward
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            data = conn.recv(16)
            if self.forward:
                with socket.create_connection(("127.0.0.1", self.port)) as onward:
                    onward.sendall(data)
                    onward.recv(1)  # held open until the prober is done

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def port() -> Iterator[int]:
    yield free_port()


def test_a_forwarded_address_leads_back_here(port: int) -> None:
    relay = _Relay(port, forward=True)
    try:
        assert leads_back_here("::1", port, timeout_s=5.0)
    finally:
        relay.close()


def test_a_proxy_that_answers_is_not_here(port: int) -> None:
    relay = _Relay(port, forward=False)
    try:
        assert not leads_back_here("::1", port, timeout_s=1.0)
    finally:
        relay.close()


def test_nothing_listening_there_is_not_here(port: int) -> None:
    assert not leads_back_here(NOT_OURS, port, timeout_s=1.0)
