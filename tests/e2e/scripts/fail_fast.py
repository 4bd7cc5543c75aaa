"""Rank FAIL_RANK dies (exit 3 after a traceback, or SIGKILL) once every other rank is asleep
with a grandchild of its own; all pids go to OUTDIR so the test can check none survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from _common import rank, wait_for_files, write_atomically


def sleep_with_grandchild(out: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_atomically(out / f"pids_{rank()}", f"{os.getpid()} {child.pid}")
    time.sleep(60)


def fail(out: Path, how: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    wait_for_files([out / f"pids_{r}" for r in range(world) if r != rank()])
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        raise ValueError(f"boom from rank {rank()}")
    except ValueError:
        traceback.print_exc()
    sys.exit(3)


if __name__ == "__main__":
    out, fail_rank, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if rank() == fail_rank:
        fail(out, how)
    else:
        sleep_with_grandchild(out)
