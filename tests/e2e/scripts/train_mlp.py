"""A few SGD steps of a small MLP with phalanx DDP; writes this rank's final parameters.

Every rank builds the same global batch from a fixed seed and trains on its own
shard (rows rank::world). With averaged gradients the result must not depend
on how the ranks are spread over hosts, which is what the multi-node test checks.
Usage: train_mlp.py OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from phalanx.ddp.module import DistributedDataParallel
from phalanx.runtime import init, shutdown

STEPS = 5
BATCH_PER_RANK = 4


def main(out: Path) -> None:
    # What the launcher chose, read before init() could fill it in by itself.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    torch.set_num_threads(1)
    world = init(backend="gloo", timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH_PER_RANK * world.world_size, 8, generator=data)
        y = x.sum(dim=1, keepdim=True).sin()
        shard = slice(world.rank, None, world.world_size)
        loss = nn.functional.mse_loss(model(x[shard]), y[shard])
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {name: p.detach().flatten().tolist() for name, p in net.named_parameters()}
    record = {
        "rank": world.rank,
        "world_size": world.world_size,
        "ifname": ifname,
        "node_rank": world.node_rank,
        "local_rank": world.local_rank,
        "local_world_size": world.local_world_size,
        "master": [world.master_addr, world.master_port],
        "launcher": world.launcher,
        "params": params,
    }
    (out / f"params_{world.rank}.json").write_text(json.dumps(record))
    print(f"rank {world.rank}: final loss {loss.item():.6f}")
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
