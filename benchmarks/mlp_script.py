"""The 8.4M-parameter MLP of ddp_step.py as a plain training script, for `phalanx bench`.

    phalanx bench --nproc 1,2 benchmarks/mlp_script.py

32 samples per rank per step (as in ddp_step.py: more ranks, more samples), phalanx
DDP with its default arguments unless --bucket-cap-mb says otherwise; it trains until
`phalanx bench` (or --steps) stops it.
"""

from __future__ import annotations

import argparse
import itertools

import models
import torch

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=0, help="0: until phalanx bench stops it")
    args = parser.parse_args()
    world = phalanx.init(backend="gloo")
    spec = models.SPECS["mlp"](False)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(spec.build(), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1000 + world.rank)
    batches = [spec.make_batch(g) for _ in range(8)]  # drawn up front, as ddp_step.py does
    steps = range(args.steps) if args.steps else itertools.count()
    for step in steps:
        inputs, targets = batches[step % len(batches)]
        spec.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
