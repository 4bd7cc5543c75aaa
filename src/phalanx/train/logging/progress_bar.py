"""The rank-0 progress bar, and the step window whose numbers are logged.

The window keeps its running loss as a tensor so no step waits on the GPU
for a `.item()`; only logging (every `logging_steps`) reads it, in one
all-reduce that every rank joins.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from phalanx.runtime import World
from phalanx.train.config.args import TrainingArguments


class Progress:
    """A tqdm bar over optimizer steps; console lines go through it so they do not tear it."""

    def __init__(self, total: int, initial: int, args: TrainingArguments) -> None:
        self.bar: Any = None
        if not args.disable_tqdm:
            # disable=None: no bar when stderr is not a terminal (a log file, a launcher pipe),
            # where every redraw would pile up on one line.
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", disable=None)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def show_loss(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepWindow:
    """Loss, samples, time and communication wait since the last reset."""

    def __init__(self, comm_wait_now: float) -> None:
        self.reset(comm_wait_now)

    def reset(self, comm_wait_now: float) -> None:
        self.started = time.perf_counter()
        self.comm_wait_start = comm_wait_now
        self.steps = 0
        self.samples = 0
        self.ran = 0
        """Steps run, skipped ones included (`steps` counts those whose loss counts)."""
        self.step_s = 0.0
        """Seconds inside those steps, not between them (callbacks, logs, saves)."""
        self.loss_sum: Tensor | None = None
        self.last_loss: Tensor | None = None
        self.grad_norm_sum: Tensor | None = None

    def add_samples(self, count: int) -> None:
        self.samples += count

    def add_time(self, seconds: float) -> None:
        self.ran += 1
        self.step_s += seconds

    def add_step(self, loss: Tensor, grad_norm: Tensor | None) -> None:
        self.steps += 1
        self.last_loss = loss
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        if grad_norm is not None:
            norm = grad_norm.detach().float()
            self.grad_norm_sum = norm if self.grad_norm_sum is None else self.grad_norm_sum + norm

    def reduce(self, world: World, comm_wait_now: float) -> dict[str, float]:
        """Averages over steps and ranks; every rank must call it at the same step."""
        local = [
            _value(self.loss_sum),
            _value(self.last_loss),
            _value(self.grad_norm_sum),
            float(self.samples),
            comm_wait_now - self.comm_wait_start,
            time.perf_counter() - self.started,
            float(self.steps),
            self.step_s,
        ]
        loss, last, norm, samples, comm, elapsed, total, step_s = world.all_reduce_sum(local)
        # Means over every rank's steps: after a live recovery a replacement's window is
        # shorter than the others', and every member must still print the same numbers.
        trained = total > 0
        ranks, total = world.world_size, max(1.0, total)
        wall = elapsed / ranks  # every rank ran the same steps: average their clocks
        out = {
            "loss": loss / total,
            "last_loss": last / ranks,
            "samples_per_second": samples / wall if wall > 0 else 0.0,
            "step_time_s": step_s / ranks / max(1, self.ran),
            "comm_wait_s": comm / total,
            "window_s": wall,
        }
        if self.grad_norm_sum is not None:
            out["grad_norm"] = norm / total
        if not trained:  # no rank took a step (a replacement alone has none: still the means)
            out = {"samples_per_second": 0.0, "window_s": wall}
        return out


def _value(tensor: Tensor | None) -> float:
    return 0.0 if tensor is None else float(tensor.detach().to(torch.float64).cpu())
