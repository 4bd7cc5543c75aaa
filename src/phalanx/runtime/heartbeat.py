"""The worker's heartbeat under `phalanx launch --live-recovery`: a file touched while the
process runs, so that its launcher can fence a worker that stopped (SIGSTOP, a wedged host)
or is wedged with the GIL held (launch/live.py reads it)."""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path

from phalanx.ground.progress_record import PROGRESS_DIR_VAR
from phalanx.ground.store_keys import HEARTBEAT_S, heartbeat_name

__all__ = ["start_heartbeat"]

_END_BEAT_S = 5.0
"""The most the exit waits for the heartbeat thread."""


def start_heartbeat(member: str) -> None:
    """Touch this worker's heartbeat file while the process runs (a daemon thread): its
    launcher fences a worker whose file goes stale (stopped, or wedged with the GIL held)."""
    directory = os.environ.get(PROGRESS_DIR_VAR)
    if not directory:
        return
    path = Path(directory) / heartbeat_name(member)
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.is_set():
            try:
                path.touch()
            except OSError:
                return
            stopped.wait(HEARTBEAT_S)

    def leave() -> None:
        """At exit: the teardown after it stops daemon threads, and freeing the gloo groups can
        take seconds, so a finished worker's file would go stale and its launcher fence it as
        stalled; without the file the launcher watches it by its exit status alone."""
        stopped.set()
        thread.join(timeout=_END_BEAT_S)
        path.unlink(missing_ok=True)

    thread = threading.Thread(target=beat, name="phalanx-heartbeat", daemon=True)
    thread.start()
    atexit.register(leave)
