"""One optimizer step of the Trainer: the micro-batches, precision, clipping, the non-finite
check, the step, the schedule.

Kept apart from the loop so the loop reads as what happens when; this is how.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx.diagnostics import timeline as timelines
from phalanx.runtime import World
from phalanx.train.batches import (
    LossFn,
    batch_size,
    call_model,
    first_loss,
    loss_weights,
    require_loss,
    takes_keyword_batch,
    to_device,
)
from phalanx.train.config.args import TrainingArguments
from phalanx.train.nonfinite import NonFiniteGuard

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline
    from phalanx.train.strategy import Strategy
    from phalanx.train.trainer_state import TrainState


def autocast_for(args: TrainingArguments, device: torch.device) -> AbstractContextManager[Any]:
    """bf16 / fp16 autocast as the arguments ask, else nothing."""
    if not (args.bf16 or args.fp16):
        return nullcontext()
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    return torch.autocast(device.type, dtype=dtype)


StepCheck = Callable[[Tensor], bool]
"""Looks at the step's gradient norm: True to step, False to skip the step (or it raises)."""


def optimizer_step(
    clip: Callable[[float], Tensor],
    optimizer: Optimizer,
    scheduler: LRScheduler,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float,
    check: StepCheck | None = None,
) -> tuple[Tensor | None, bool]:
    """Unscale (fp16), clip, check, step, schedule, clear the gradients.

    Returns the norm before clipping (None when neither clipping nor `check`
    needed it), and False when `check` skipped the step (nothing stepped, the
    gradients cleared). Under fp16 the GradScaler skips non-finite steps
    itself, so `check` is not asked.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
        check = None
    measure = max_grad_norm > 0 or check is not None
    grad_norm = clip(max_grad_norm or math.inf) if measure else None
    if check is not None and grad_norm is not None and not check(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, False
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
    return grad_norm, True


class StepRunner:
    """One optimizer step of the Trainer: the micro-batches' forwards and weighted backwards
    (all but the last under no_sync, so one all-reduce per step), then `optimizer_step`
    with the non-finite check."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        scaler: torch.amp.GradScaler | None,
        args: TrainingArguments,
        world: World,
        guard: NonFiniteGuard,
        timeline: Timeline | None = None,
    ) -> None:
        self.model = model
        self.strategy = strategy
        """Asked what differs between the stages: the wrapper to call, how a micro-batch
        runs (no_sync), how to clip, who records the timeline."""
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.args = args
        self.world = world
        self.guard = guard
        self.timeline = timeline
        """Where the optimizer step is recorded, and forward and backward too when the model
        is not wrapped (DDP and its reducer record their own); None: off."""
        self._reduced = args.sync_method == "ddp"
        """Whether gradients are averaged over ranks each step (not under local SGD/DiLoCo)."""
        self._keyword: bool | None = None
        """Whether a batch is spread into keyword arguments; found at the first batch."""
        self.shadow: Callable[[], None] | None = None
        """Under Join (even_batches=False): plays the other ranks' micro-batches that this
        rank has no data for, up to the step's reduction."""

    def run(
        self, batches: list[Any], expected: int, loss_fn: LossFn | None, state: TrainState
    ) -> StepResult:
        """Train one step on `batches`, this rank's micro-batches of a step of `expected`
        (fewer only under even_batches=False, where `shadow` plays the missing ones)."""
        started = time.perf_counter()
        sizes = [batch_size(batch) for batch in batches]
        weights = loss_weights(sizes, self.world, reduced=self._reduced)
        synced = expected - 1  # the step's last micro-batch reduces, the others accumulate
        losses = [
            self._micro_step(batch, weight, index == synced, loss_fn)
            for index, (batch, weight) in enumerate(zip(batches, weights, strict=True))
        ]
        if len(batches) < expected:
            assert self.shadow is not None, "a short step without Join"
            self.shadow()
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.world.device)
        check = None if self.guard.action == "off" else self._check(loss, state)
        if check is not None and not self._reduced and self.world.is_distributed:
            check = self._agreed(check)
        with timelines.span_of(self.timeline, "optimizer step"):
            grad_norm, stepped = optimizer_step(
                functools.partial(self.strategy.clip, self.model, self.optimizer),
                self.optimizer,
                self.scheduler,
                self.scaler,
                self.args.max_grad_norm,
                check,
            )
        return StepResult(loss, grad_norm, stepped, sum(sizes), time.perf_counter() - started)

    def _check(self, loss: Tensor, state: TrainState) -> StepCheck:
        return lambda grad_norm: self.guard.allows_step(grad_norm, loss, state)

    def _agreed(self, check: StepCheck) -> StepCheck:
        """With no reducer each rank's norm is its own: agree (one number) whether any rank's
        is non-finite, so that every rank steps or skips alike and the syncs stay aligned."""

        def agreed(grad_norm: Tensor) -> bool:
            bad = self.world.all_reduce_sum([0.0 if bool(torch.isfinite(grad_norm)) else 1.0])
            return check(grad_norm if bad[0] == 0 else grad_norm.new_tensor(math.inf))

        return agreed

    def _micro_step(self, batch: Any, weight: float, sync: bool, loss_fn: LossFn | None) -> Tensor:
        """Forward and backward of one micro-batch; its loss times `weight`, detached."""
        batch = to_device(batch, self.world.device)
        first = self._keyword is None
        if self._keyword is None:
            self._keyword = takes_keyword_batch(self.model, batch)
        wrapped = self.strategy.wrapped
        assert wrapped is not None
        # DDP and a fully_shard root record their own forward, backward and collectives.
        timeline = None if self.strategy.records_own_timeline else self.timeline
        with self.strategy.micro_step(sync):  # DDP: no all-reduce but the step's last
            forward = timelines.forward_of(timeline, batch_size(batch))
            with autocast_for(self.args, self.world.device), forward:
                if first:  # a slip of convention is one line here, not a raw error
                    _, loss = first_loss(wrapped, batch, self._keyword, loss_fn)
                else:
                    outputs = call_model(wrapped, batch, self._keyword)
                    loss = require_loss(outputs, batch, loss_fn)
            weighted = loss.float() * weight
            scaled = self.scaler.scale(weighted) if self.scaler is not None else weighted
            with timelines.local_backward_of(timeline, sync):
                scaled.backward()
        return weighted.detach()


@dataclass(frozen=True)
class StepResult:
    """What one step left behind, for the logs."""

    loss: Tensor
    """This rank's share of the step's mean loss: the mean over ranks is the step's loss."""
    grad_norm: Tensor | None
    stepped: bool
    """False when the non-finite check skipped the step."""
    samples: int
    """This rank's samples in the step."""
    seconds: float = 0.0
    """The step's own time on this rank: forward, backward, optimizer step (no callback,
    log line, evaluation or save: what runs between steps is not the step)."""
