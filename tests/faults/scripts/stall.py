"""A few DDP steps in which ranks STALL_RANKS stop at step STALL_STEP (they sleep, as a rank
stuck in data loading or a deadlocked thread would); the others wait in the next all-reduce
until init(timeout=TIMEOUT) runs out. A stalling rank writes the time it stalled to
OUTDIR/stalled_<rank>.
Usage: stall.py STALL_RANKS(comma-separated) STALL_STEP TIMEOUT OUTDIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import phalanx


def stall_here() -> None:
    time.sleep(600)


def main(stall_ranks: set[int], stall_step: int, timeout: float, out: Path) -> None:
    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo", timeout=timeout)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, stall_step + 3):
        if world.rank in stall_ranks and step == stall_step:
            (out / f"stalled_{world.rank}").write_text(str(time.time()))
            print(f"rank {world.rank} stalls at step {step}", flush=True)
            stall_here()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    phalanx.shutdown()


if __name__ == "__main__":
    ranks = {int(r) for r in sys.argv[1].split(",")}
    main(ranks, int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
