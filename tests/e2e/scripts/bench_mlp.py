"""A plain phalanx DDP loop with no end of its own, for `phalanx bench` (which stops it).

A fixed global batch of 64 split between the ranks, and small buckets
(--bucket-cap-mb, default 0.1) so that even this small MLP sends several.
Writes nothing: `phalanx bench` reads the timeline.
Usage: bench_mlp.py [--bucket-cap-mb MB]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import phalanx

GLOBAL_BATCH = 64


def build() -> nn.Module:
    """32 -> 256 -> 256 -> 1: 74,497 parameters, 297,988 bytes of float32 gradients."""
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    args = parser.parse_args()
    world = phalanx.init(backend="gloo")
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(build(), bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_rank = GLOBAL_BATCH // world.world_size
    while True:  # phalanx bench ends the script after its steps
        x = torch.randn(per_rank, 32)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
