"""A few DDP steps in which rank STALL_RANK stops at step STALL_STEP (it sleeps, as a rank
stuck in data loading or a deadlocked thread would); the others wait in the next all-reduce
until init(timeout=TIMEOUT) runs out.
Usage: stall.py STALL_RANK STALL_STEP TIMEOUT
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import phalanx


def stall_here() -> None:
    time.sleep(600)


def main(stall_rank: int, stall_step: int, timeout: float) -> None:
    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo", timeout=timeout)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, stall_step + 3):
        if world.rank == stall_rank and step == stall_step:
            print(f"rank {world.rank} stalls at step {step}", flush=True)
            stall_here()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    phalanx.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
