"""A worker that takes 30 s to stop on SIGTERM (as a Trainer whose preemption save has
more to write than it is given), with a grandchild that ignores SIGTERM outright; both
pids go to OUTDIR/pids_<rank>. Only SIGKILL ends them within the test.
Usage: slow_to_stop.py OUTDIR
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from _common import rank, write_atomically

_IGNORING_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
)


def save_for_a_while(signum: int, frame: FrameType | None) -> None:
    time.sleep(30)
    sys.exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, save_for_a_while)
    child = subprocess.Popen([sys.executable, "-c", _IGNORING_CHILD])
    write_atomically(Path(sys.argv[1]) / f"pids_{rank()}", f"{os.getpid()} {child.pid}")
    time.sleep(60)
