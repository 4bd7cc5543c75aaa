"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to 0.

A plain function inside `LambdaLR`: its state_dict then holds numbers only
(the step count), so it round-trips through a weights_only checkpoint.
Hugging Face's other schedules come from transformers' own `get_scheduler`
(the `hf` extra), which makes the same kind of `LambdaLR`: the same numbers
as a Hugging Face run, with nothing re-implemented here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn, get_args

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from phalanx.errors import ConfigurationError

NativeSchedule = Literal["constant", "linear", "cosine"]
"""phalanx's own schedules: mypy checks that `_decay` has a branch for each name."""
HFSchedule = Literal[
    "constant_with_warmup",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
]
"""Hugging Face's, run by transformers' get_scheduler."""
ScheduleName = Literal[NativeSchedule, HFSchedule]
"""The one list of schedules: TrainingArguments.lr_scheduler_type takes its type from it."""
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
NATIVE: tuple[str, ...] = get_args(NativeSchedule)


def _decay(kind: NativeSchedule) -> Callable[[float], float]:
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


def lr_factor(kind: NativeSchedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate after `step` optimizer steps."""
    decay = _decay(kind)  # an unknown name, passed unchecked, is an error here
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return decay(min(1.0, (step - warmup_steps) / decay_steps))

    return factor


def warmup_steps_for(warmup_steps: float, warmup_ratio: float, total_steps: int) -> int:
    """Hugging Face's reading: whole steps, or a fraction in (0, 1) of the run (as is
    warmup_ratio, used when warmup_steps is 0), rounded up."""
    if warmup_steps >= 1:
        return int(warmup_steps)
    fraction = warmup_steps if warmup_steps > 0 else warmup_ratio
    return math.ceil(fraction * total_steps)


def make_scheduler(
    optimizer: Optimizer,
    kind: ScheduleName,
    warmup_steps: int,
    total_steps: int,
    kwargs: Mapping[str, Any] | None = None,
) -> LambdaLR:
    if kind in NATIVE:
        if kwargs:
            raise ConfigurationError(
                f"lr_scheduler_kwargs={dict(kwargs)} do not apply to lr_scheduler_type="
                f"{kind!r} (it takes none) — drop them"
            )
        return LambdaLR(optimizer, lr_factor(kind, warmup_steps, total_steps))  # type: ignore[arg-type]
    try:
        from transformers import get_scheduler
    except ImportError:
        raise ConfigurationError(
            f"lr_scheduler_type={kind!r} is Hugging Face's, run by transformers' own "
            "get_scheduler — pip install 'phalanx[hf]', or use constant, linear or cosine"
        ) from None
    try:
        scheduler = get_scheduler(
            kind,
            optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            scheduler_specific_kwargs=dict(kwargs or {}),
        )
    except TypeError as e:
        raise ConfigurationError(
            f"lr_scheduler_kwargs={dict(kwargs or {})} do not fit lr_scheduler_type={kind!r} "
            f"({e}) — pass the arguments transformers' schedule takes"
        ) from None
    assert isinstance(scheduler, LambdaLR)
    return scheduler
