"""What a non-master node checks before it spawns: that the master is reachable.

There is no launcher-side store: rank 0's `init_process_group` opens the TCP
store at MASTER_ADDR:MASTER_PORT and every other rank connects to it. Which
interface gloo advertises is decided in `phalanx.netif`, for launcher and
workers alike.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from phalanx.errors import MasterUnreachableError

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
_CONNECT_TIMEOUT_S = 5.0
_CANCEL_POLL_S = 0.1


def _can_connect(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_master(
    host: str,
    port: int,
    timeout_s: float,
    announce: Callable[[str], None],
    cancelled: Callable[[], bool] = lambda: False,
) -> bool:
    """Block until HOST:PORT accepts a TCP connection (True), or `cancelled()` (False).

    Raises `MasterUnreachableError` after `timeout_s`. Only non-master nodes
    call this: the port opens when rank 0's worker, on node 0, creates its
    TCP store, so node 0 waiting for it would wait for itself. The backoff
    keeps a node that starts long before the master from hammering it.
    """
    deadline = time.monotonic() + timeout_s
    backoff = _FIRST_BACKOFF_S
    announced = False
    while not cancelled():
        left = deadline - time.monotonic()
        if _can_connect(host, port, timeout_s=max(0.1, min(left, _CONNECT_TIMEOUT_S))):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            raise MasterUnreachableError(
                f"cannot reach the master at {host}:{port} after {timeout_s:g}s — check "
                "--master-addr, the port and the firewall, and that node 0 is running"
            )
        if not announced:
            announce(f"waiting for the master at {host}:{port} (up to {timeout_s:g}s)")
            announced = True
        _sleep_unless(cancelled, min(backoff, left))
        backoff = min(backoff * 2, _MAX_BACKOFF_S)
    return False


def _sleep_unless(cancelled: Callable[[], bool], seconds: float) -> None:
    """Sleep in short slices so a Ctrl-C during a long backoff is honoured at once."""
    end = time.monotonic() + seconds
    while not cancelled() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, _CANCEL_POLL_S))
