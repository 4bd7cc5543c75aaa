"""Which optimizer a run steps: the one the Trainer builds, or one the user brings.

Hugging Face's Trainer takes `optimizers=(optimizer, scheduler)` and
`optimizer_cls_and_kwargs=(cls, kwargs)`; phalanx's also takes `optimizer=`.
They are one choice, checked once here, and every strategy builds from it:
stages 1 and 2 shard the user's class over the same groups, stage 3 steps the
units' shards, and under disk offload any of them streams its state to files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx.errors import ConfigurationError

__all__ = ["NEEDS_CLOSURE", "OptimizerChoice"]

NEEDS_CLOSURE = {
    "LBFGS": "re-evaluates the loss several times per step through a closure",
}
"""Optimizers whose step needs what the Trainer's step does not give (the reason)."""


@dataclass(frozen=True)
class OptimizerChoice:
    """What the user passed; all None: the Trainer builds `args.optim`."""

    optimizer: Optimizer | None = None
    scheduler: LRScheduler | None = None
    cls_and_kwargs: tuple[type[Optimizer], dict[str, Any]] | None = field(default=None)

    @classmethod
    def of(
        cls,
        optimizer: Optimizer | None,
        optimizers: tuple[Optimizer | None, LRScheduler | None] | None,
        optimizer_cls_and_kwargs: tuple[type[Optimizer], dict[str, Any]] | None,
    ) -> OptimizerChoice:
        """One choice from the Trainer's three arguments, or one line saying which clash."""
        given_opt, scheduler = optimizers if optimizers is not None else (None, None)
        if optimizer is not None and given_opt is not None:
            raise ConfigurationError(
                "optimizer= and optimizers=(optimizer, scheduler) both give an optimizer — "
                "pass one of them"
            )
        chosen = optimizer if optimizer is not None else given_opt
        if optimizer_cls_and_kwargs is not None and chosen is not None:
            raise ConfigurationError(
                "optimizer_cls_and_kwargs builds the optimizer, and optimizer(s)= gives one "
                "built already — pass one of them (Hugging Face's Trainer refuses both too)"
            )
        if scheduler is not None and chosen is None:
            raise ConfigurationError(
                "optimizers=(None, scheduler): a scheduler needs the optimizer it was built "
                "over — pass optimizers=(optimizer, scheduler), or lr_scheduler_type"
            )
        if optimizer_cls_and_kwargs is not None:
            _check_class_and_kwargs(optimizer_cls_and_kwargs)
        choice = cls(chosen, scheduler, optimizer_cls_and_kwargs)
        name = "" if choice.user_class is None else choice.user_class.__name__
        if name in NEEDS_CLOSURE:
            raise ConfigurationError(
                f"{name} {NEEDS_CLOSURE[name]}, which the Trainer's step (one backward, then "
                "optimizer.step()) does not give — use an optimizer that steps from the "
                "gradients alone (AdamW, SGD, ...), or write your own loop"
            )
        return choice

    @property
    def user_class(self) -> type[Optimizer] | None:
        if self.optimizer is not None:
            return type(self.optimizer)
        return None if self.cls_and_kwargs is None else self.cls_and_kwargs[0]


def _check_class_and_kwargs(pair: tuple[type[Optimizer], dict[str, Any]]) -> None:
    ok = isinstance(pair, tuple) and len(pair) == 2
    if not ok or not (isinstance(pair[0], type) and issubclass(pair[0], Optimizer)):
        raise ConfigurationError(
            f"optimizer_cls_and_kwargs={pair!r} is not (an Optimizer class, a dict of its "
            "options) — e.g. optimizer_cls_and_kwargs=(torch.optim.AdamW, {'lr': 3e-4})"
        )
    if not isinstance(pair[1], dict):
        raise ConfigurationError(
            f"optimizer_cls_and_kwargs[1] is a {type(pair[1]).__name__}, not a dict of "
            f"{pair[0].__name__}'s options — e.g. {{'lr': 3e-4}}"
        )
