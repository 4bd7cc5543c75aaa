"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to 0.

A plain function inside `LambdaLR`: its state_dict then holds numbers only
(the step count), so it round-trips through a weights_only checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from phalanx.errors import ConfigurationError


def lr_factor(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate after `step` optimizer steps."""
    if kind not in ("constant", "linear", "cosine"):
        raise ConfigurationError(
            f"lr_scheduler_type={kind!r} is unknown — use constant, linear or cosine"
        )
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def make_scheduler(
    optimizer: Optimizer, kind: str, warmup_steps: int, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lr_factor(kind, warmup_steps, total_steps))
