"""The supervise loops see a worker's exit when it happens, not a poll later."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from phalanx.launch.workers import wait_for_an_exit

_LONG_S = 60.0


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.timeout(60)
def test_an_exit_ends_the_wait_not_the_timeout() -> None:
    stays, goes = _child("import time; time.sleep(600)"), _child("import sys; sys.stdin")
    try:
        started = time.monotonic()
        wait_for_an_exit(
            cast(Any, [SimpleNamespace(pid=stays.pid), SimpleNamespace(pid=goes.pid)]), _LONG_S
        )
        assert time.monotonic() - started < _LONG_S / 2, "the wait ran to its timeout"
        assert goes.wait(5) == 0 and stays.poll() is None
    finally:
        stays.kill()
        stays.wait()


@pytest.mark.timeout(30)
def test_nothing_to_watch_is_a_plain_sleep() -> None:
    gone = _child("pass")
    gone.wait()  # reaped: its pid names no child of ours any more
    started = time.monotonic()
    wait_for_an_exit(cast(Any, [SimpleNamespace(pid=gone.pid)]), 0.2)
    wait_for_an_exit([], 0.2)
    assert time.monotonic() - started >= 0.2
