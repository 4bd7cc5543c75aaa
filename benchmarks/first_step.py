"""A training script that reports when its first step is done (for startup.py).

The same script runs under `phalanx launch` and under torchrun: init, the model
wrapped in phalanx DDP, one forward/backward/optimizer step; rank 0 then prints
FIRST_STEP <wall-clock seconds> and the job ends.
"""

from __future__ import annotations

import time

import torch

import phalanx


def main() -> None:
    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo")
    model = phalanx.DistributedDataParallel(torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    if world.rank == 0:
        print(f"FIRST_STEP {time.time():.6f}", flush=True)
    phalanx.shutdown()


if __name__ == "__main__":
    main()
