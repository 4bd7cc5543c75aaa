"""A Trainer run with no end of its own, for `phalanx bench`: it stops the script.

A small MLP regression with a fixed global batch split between the ranks, so
more ranks mean less compute per rank and the same bytes per step. The
Trainer records its timeline because `phalanx bench` sets PHALANX_TIMELINE.
Usage: bench_trainer.py OUTDIR
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from phalanx.train import Trainer, TrainingArguments

GLOBAL_BATCH = 64


class Regression(nn.Module):
    """An MLP that takes the Trainer's (inputs, targets) batch and returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                 nn.Linear(256, 1))  # fmt: skip

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)


def main(out: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=out,
        max_steps=10_000,  # far more than bench's steps: bench ends the script
        per_device_train_batch_size=GLOBAL_BATCH // world,
        save_steps=0,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    Trainer(Regression(), args, train_dataset=data).train()


if __name__ == "__main__":
    main(sys.argv[1])
