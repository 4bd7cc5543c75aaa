"""Rank 0 draws a tqdm bar over STEPS steps while rank 1 prints a line now and then: the
launcher must pass the bar's redraws on to its terminal without tearing rank 1's lines."""

from __future__ import annotations

import sys
import time

from _common import rank
from tqdm import tqdm

if __name__ == "__main__":
    steps = int(sys.argv[1])
    if rank() == 0:
        for _ in tqdm(range(steps), desc="train", mininterval=0):
            time.sleep(0.05)
    else:
        for i in range(3):
            time.sleep(0.1)
            print(f"rank 1 line {i}", flush=True)
