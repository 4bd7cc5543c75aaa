"""Ignore SIGTERM (as a worker stuck in C code effectively does) and sleep: only SIGKILL,
after the launcher's shutdown timeout, ends it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from _common import rank, write_atomically

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_atomically(Path(sys.argv[1]) / f"ready_{rank()}", str(os.getpid()))
    time.sleep(60)
