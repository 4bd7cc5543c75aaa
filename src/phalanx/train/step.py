"""One optimizer step of the Trainer: precision, clipping, the step, the schedule.

Kept apart from the loop so the loop reads as what happens when; this is how.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx import zero3
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.train.args import TrainingArguments


def autocast_for(args: TrainingArguments, device: torch.device) -> AbstractContextManager[Any]:
    """bf16 / fp16 autocast as the arguments ask, else nothing."""
    if not (args.bf16 or args.fp16):
        return nullcontext()
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def clip_gradients(model: nn.Module, optimizer: Optimizer, max_norm: float) -> Tensor:
    """Clip the global gradient norm (after the all-reduce: the same on every rank)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        # The norm from the shards (one all-reduce): under stage 2 no rank holds the
        # whole gradient that torch's clip would read.
        return optimizer.clip_grad_norm_(max_norm)
    if zero3.unit_of(model) is not None:
        return zero3.clip_grad_norm_(model, max_norm)  # stage 3: the same, over its pieces
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def optimizer_step(
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float,
) -> Tensor | None:
    """Unscale (fp16), clip, step, schedule, clear the gradients; the norm before clipping."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, optimizer, max_grad_norm) if max_grad_norm > 0 else None
    stepped = True
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        stepped = scaler.get_scale() >= scale  # a lowered scale means inf/NaN: skipped
    else:
        optimizer.step()
    if stepped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
