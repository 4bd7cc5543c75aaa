"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to 0.

A plain function inside `LambdaLR`: its state_dict then holds numbers only
(the step count), so it round-trips through a weights_only checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NoReturn, get_args

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from phalanx.errors import ConfigurationError

ScheduleName = Literal["constant", "linear", "cosine"]
"""The one list of schedules: TrainingArguments.lr_scheduler_type takes its type from it,
and mypy checks that `_decay` has a branch for each name."""
SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)


def _decay(kind: ScheduleName) -> Callable[[float], float]:
    """The multiplier after warmup, as a function of the fraction of decay steps done."""
    if kind == "constant":
        return lambda progress: 1.0
    if kind == "linear":
        return lambda progress: 1.0 - progress
    if kind == "cosine":
        return lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress))
    return _unknown(kind)


def _unknown(kind: NoReturn) -> NoReturn:
    # mypy accepts the call in _decay only while every ScheduleName has a branch;
    # at run time it catches a name passed without TrainingArguments' check.
    raise ConfigurationError(
        f"lr_scheduler_type={kind!r} is unknown — use one of {', '.join(SCHEDULES)}"
    )


def lr_factor(kind: ScheduleName, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate after `step` optimizer steps."""
    decay = _decay(kind)  # an unknown name, passed unchecked, is an error here
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return decay(min(1.0, (step - warmup_steps) / decay_steps))

    return factor


def make_scheduler(
    optimizer: Optimizer, kind: ScheduleName, warmup_steps: int, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lr_factor(kind, warmup_steps, total_steps))
