"""Busy background processes for a benchmark run "under load": `with busy(2): ...` keeps two
processes spinning in pure Python (one core's worth each, no I/O, no memory to speak of)
for the duration, then kills them. A shared machine is the normal case; the load makes a
benchmark show what its threads lose to other processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["busy", "describe", "machine", "moment"]

_SPIN = "while True: pass"


@contextlib.contextmanager
def busy(count: int) -> Iterator[list[int]]:
    """`count` spinning processes while the block runs (their pids); none for 0."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
        for _ in range(max(0, count))
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def describe(count: int) -> str:
    return "quiet" if count == 0 else f"{count} busy background processes (pure-Python spin)"


def moment() -> dict[str, object]:
    """Now, for a report: the UTC minute and the load average (1, 5, 15 minutes)."""
    return {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load": os.getloadavg()}


def machine(started: dict[str, object], **more: object) -> dict[str, object]:
    """A report's machine: its cores, `started` (a `moment()` from the start), the load
    average at the end, and `more`."""
    return {"cores": os.cpu_count(), **more, "started": started, "load_at_end": os.getloadavg()}
