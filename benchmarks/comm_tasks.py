"""The two training tasks `comm_methods.py` compares communication methods on.

- `mlp`: the 8.4M-parameter MLP of models.py (1024-2048-2048-1024-10, 33 MB of
  gradients per step) learning a noisy linear map, y = A x + 0.1 e. Fresh
  samples every step (no overfitting), and a known optimum: no predictor
  beats the noise, so the best validation loss is the noise's mean square on
  the validation set, printed beside the results.
- `gpt`: examples/char_gpt.py's model and data (the stdlib's own source,
  character-level), shrunk to 2 layers and 64-character windows so six
  copies of it train on two CPU cores in minutes.

Every batch is a function of (rank, step) only, so every method sees the very
same samples in the same order.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import models
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import char_gpt  # an example script, not a package

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class Task:
    name: str
    build: Callable[[], nn.Module]
    """The model; the caller seeds the RNG first, so every method starts from the same one."""
    batch: Callable[[int, int], Batch]
    """(rank, step) -> this rank's batch for that step."""
    val: list[Batch]
    """The validation set in batches; rank r scores batches r, r + world, ..."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: float
    """Peak AdamW learning rate (warm-up, then cosine decay: char_gpt.lr_at)."""
    weight_decay: float
    optimum: float | None
    """The best validation loss any model can reach, where it is known."""


def _generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (2**62))


def mlp_task(tiny: bool, per_rank_batch: int, seed: int) -> Task:
    dims = [16, 32, 10] if tiny else [1024, 2048, 2048, 1024, 10]
    noise = 0.1
    # Entries of variance 1/d_in: every target has unit variance before the noise.
    teacher = torch.randn(dims[-1], dims[0], generator=_generator(seed, -1)) / math.sqrt(dims[0])

    def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(n, dims[0], generator=g)
        e = noise * torch.randn(n, dims[-1], generator=g)
        return x, x @ teacher.T + e, e

    def batch(rank: int, step: int) -> Batch:
        x, y, _ = sample(_generator(seed, rank, step), per_rank_batch)
        return x, y

    n_val = 64 if tiny else 4096
    x, y, e = sample(_generator(seed, -2), n_val)
    val = list(zip(x.split(256), y.split(256)))
    return Task(
        name="mlp",
        build=lambda: models.MLP(dims),
        batch=batch,
        val=val,
        loss=F.mse_loss,
        lr=1e-3,
        weight_decay=0.0,
        optimum=float(e.pow(2).mean()),
    )


def gpt_task(tiny: bool, per_rank_batch: int, seed: int) -> Task:
    block, layers, heads, embd = (16, 1, 2, 16) if tiny else (64, 2, 4, 128)
    ids = char_gpt.encode(char_gpt.read_stdlib(200_000 if tiny else 1_000_000))
    split = int(len(ids) * (1 - char_gpt.VAL_FRACTION))
    train = char_gpt.Windows(ids[:split], block)
    val_windows = char_gpt.Windows(ids[split:], block)

    def batch(rank: int, step: int) -> Batch:
        picks = torch.randint(
            0, len(train), (per_rank_batch,), generator=_generator(seed, rank, step)
        )
        xs, ys = zip(*(train[int(i)] for i in picks))
        return torch.stack(xs), torch.stack(ys)

    n_val = 32 if tiny else 512
    windows = [val_windows[i] for i in range(min(n_val, len(val_windows)))]
    val = [
        (
            torch.stack([w[0] for w in windows[i : i + 32]]),
            torch.stack([w[1] for w in windows[i : i + 32]]),
        )
        for i in range(0, len(windows), 32)
    ]
    return Task(
        name="gpt",
        build=lambda: char_gpt.CharGPT(block, layers, heads, embd),
        batch=batch,
        val=val,
        loss=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        lr=char_gpt.LEARNING_RATE,
        weight_decay=0.1,
        optimum=None,
    )


TASKS: dict[str, Callable[[bool, int, int], Task]] = {"mlp": mlp_task, "gpt": gpt_task}
