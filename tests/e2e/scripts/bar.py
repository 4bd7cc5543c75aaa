"""Rank 0 draws a tqdm bar over STEPS steps while rank 1 prints a line now and then: the
launcher must pass the bar's redraws on to its terminal without tearing rank 1's lines.

Rank 1 prints only while the bar is live (files in the directory DIR say so both ways),
so that a slow start of either rank on a loaded machine does not change what is on screen.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import rank
from tqdm import tqdm


def wait_for(path: Path, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    steps, folder = int(sys.argv[1]), Path(sys.argv[2])  # bar.py STEPS DIR
    STARTED, DONE = folder / "bar.started", folder / "bar.rank1-done"
    if rank() == 0:
        for step in tqdm(range(steps), desc="train", mininterval=0):
            if step == 1:
                STARTED.touch()
            if step == steps - 1:
                wait_for(DONE)
            time.sleep(0.05)
    else:
        wait_for(STARTED)
        for i in range(3):
            time.sleep(0.1)
            print(f"rank 1 line {i}", flush=True)
        DONE.touch()
