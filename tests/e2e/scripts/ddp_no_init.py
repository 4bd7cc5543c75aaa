"""A torchrun script converted to phalanx by changing one import: it never calls phalanx.init().

It reports, at exit, whether the process group is still alive. Its reporter is
registered before the model is wrapped, so it runs after any exit hook the
wrapper installs (atexit runs last-registered first): "alive: False" means
DistributedDataParallel installed the gloo teardown that phalanx.init() would.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch import nn

from phalanx import DistributedDataParallel  # was: from torch.nn.parallel import ...


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    atexit.register(lambda: print(f"rank {rank}: group alive at exit: {dist.is_initialized()}"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {rank}: trained", flush=True)


if __name__ == "__main__":
    main()
