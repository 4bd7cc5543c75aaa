"""A plain DDP loop in which rank r has 3 + 2r batches, without Join: rank 0 runs out
first. MODE says how rank 0 ends: `exit` (its loop is over and the script ends, as a
loop out of data does) or `raise` (an uncaught error in its last step: a failure, not
a rank out of data).
Usage: uneven_steps.py MODE
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import phalanx


def main(mode: str) -> None:
    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo", timeout=60)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 3 + 2 * world.rank
    for step in range(batches):
        if mode == "raise" and world.rank == 0 and step == batches - 1:
            raise ValueError("rank 0 failed in its last step")
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1])
