"""Trap SIGINT, SIGTERM and SIGUSR1, note which one arrived in OUTDIR/got_<rank>, then exit."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from _common import rank, write_atomically

OUT = Path(sys.argv[1])


def on_signal(signum: int, _frame: FrameType | None) -> None:
    write_atomically(OUT / f"got_{rank()}", signal.Signals(signum).name)
    sys.exit(0)


if __name__ == "__main__":
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, on_signal)
    write_atomically(OUT / f"ready_{rank()}", str(os.getpid()))
    time.sleep(60)
