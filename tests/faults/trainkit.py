"""What the Trainer fault tests share: a small model with dropout, its data, and a loss
that can be told to misbehave at a given step on a given rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.train import Trainer, TrainingArguments

Fault = Callable[[Trainer], float | None]
"""Called in the loss of every micro-batch: a factor for the loss (NaN poisons it), or None."""


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def dataset(samples: int = 64) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=gen)
    return TensorDataset(x, torch.randint(0, 3, (samples,), generator=gen))


def make_trainer(
    out_dir: Path | str,
    fault: Fault | None = None,
    model: nn.Module | None = None,
    **overrides: Any,
) -> Trainer:
    """A Trainer of DropoutNet (or `model`) on `dataset()`: 8 steps per epoch on 2 ranks
    (batch 4)."""
    settings: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": 8,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "save_steps": 0,
        "report_to": [],
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 60,
        **overrides,
    }
    box: list[Trainer] = []

    def loss_fn(outputs: Tensor, batch: list[Tensor]) -> Tensor:
        loss = nn.functional.cross_entropy(outputs, batch[1])
        factor = fault(box[0]) if fault is not None else None
        return loss if factor is None else loss * factor

    trainer = Trainer(
        model=model if model is not None else DropoutNet(),
        args=TrainingArguments(**settings),
        train_dataset=dataset(),
        loss_fn=loss_fn,
    )
    box.append(trainer)
    return trainer


def in_step(trainer: Trainer, step: int, rank: int | None = None) -> bool:
    """Whether `trainer` is training optimizer step `step` (1-based) on `rank` (any: None)."""
    on_rank = rank is None or trainer.world.rank == rank
    return on_rank and trainer.state.global_step + 1 == step


def parameters(trainer: Trainer) -> list[list[float]]:
    """The parameters as plain lists (tensors must not travel through the harness queue)."""
    return [p.detach().reshape(-1).tolist() for p in trainer.model.parameters()]
