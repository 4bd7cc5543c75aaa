"""A phalanx script run by `accelerate launch`: phalanx's DDP for the model, accelerate for
the optimizer and the data (`prepare(optimizer, loader)`), as docs/launch.md recommends.

Writes OUT/result_<rank>.json: the world it saw, and the replica check's verdict. With
`wrap-twice`, it hands accelerate the DDP model too (the mistake phalanx refuses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    world = phalanx.init()  # before Accelerator(): it then uses this group
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    if mode == "wrap-twice":
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        optimizer, loader = accelerator.prepare(optimizer, loader)
    steps = 0
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    phalanx.check_replicas(model)  # raises on every rank if they drifted apart
    record = {
        "rank": world.rank,
        "world_size": world.world_size,
        "steps": steps,
        "accelerate_processes": accelerator.num_processes,
    }
    (out / f"result_{world.rank}.json").write_text(json.dumps(record))
