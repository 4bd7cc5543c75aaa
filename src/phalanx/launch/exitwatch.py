"""A worker hung in its exit: its script has ended, its teardown never does.

Every worker's progress record says when its interpreter began to exit
(ground/progress_record.py: after the script's own threads ended, before the exit
handlers). A worker still running `--exit-timeout` seconds after that is hung in a
handler or a group's teardown, and its launcher would wait for it forever (torchrun
does): instead it shows where the worker hangs (its Python stacks), says so in one
line and kills it. The default is generous, since an exit handler may upload (a
metrics logger's last sync).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.ground.progress_record import read_record, record_path
from phalanx.launch.procgroup import signal_group
from phalanx.launch.summary import collect_stacks
from phalanx.launch.workers import Worker

__all__ = ["fence_hung_exit"]


def fence_hung_exit(
    worker: Worker, who: str, progress_dir: Path, limit_s: float, say: Callable[[str], None]
) -> float | None:
    """Kill `worker` (SIGKILL) when it began to exit more than `limit_s` ago, after saying
    where it hangs; the seconds since its exit began, or None when it was left alone."""
    position = read_record(record_path(progress_dir, worker.rank))
    if position is None or position.pid != worker.pid or not position.exiting:
        return None  # still at work, or the record is another process's (a predecessor's)
    age = time.time() - position.exiting
    if age <= limit_s:
        return None
    stacks = collect_stacks([worker], {worker.rank: position}, progress_dir)
    lines = "".join(f"\n  | {line}" for line in stacks.get(worker.rank, []))
    say(
        f"{who} began to exit {age:.1f} s ago and has not ended (--exit-timeout {limit_s:g}): "
        f"hung in its teardown; killing it (SIGKILL). Where it hangs:"
        + (lines or " (no stacks: the dump signal was not armed)")
    )
    signal_group(worker.pid, signal.SIGKILL)
    return age
