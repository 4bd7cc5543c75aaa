"""Uneven inputs: `Join`, so ranks with more batches finish their epoch without a hang.

torch's semantics and names (`torch.distributed.algorithms.join`): inside
`with Join([model]):` (or `with model.join():`), a rank that runs out of
batches leaves the loop and, in `__exit__`, *shadows* the collectives of the
ranks still training, one iteration at a time, until every rank has run out;
then all ranks take the model of the last rank to finish.

The protocol, one message per DDP forward (one small all-reduce):
- a training rank sends 1 in its own slot, and its plan for the iteration:
  whether its backward reduces, whether it broadcasts buffers, whether it
  rebuilds the buckets first;
- a rank out of batches sends zeros, learns from the sum who still trains
  and what they will do, and issues the same collectives with no gradient
  of its own (phalanx.ddp.reducer.shadow_iteration).
Buffers then come from the highest rank still training (torch's rule: rank 0
may have run out, and its buffers are stale). A message with no rank
training ends the loop. With `throw_on_early_termination=True`, the first
message in which some rank is missing makes every rank raise
`UnevenInputsError` naming it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError, UnevenInputsError
from phalanx.parallel.traffic import Collective, ReducerStats, Traffic

__all__ = ["Join", "JoinConfig", "JoinHook", "JoinRound", "Joinable", "Shadowed"]


class Shadowed(Enum):
    """What one `Join.shadow_round` took part in."""

    NOTHING_LEFT = "nothing_left"
    """No rank trains any more: the loop is over."""
    FORWARD = "forward"
    """A forward whose backward does not reduce (no_sync, or no grad)."""
    REDUCED = "reduced"
    """A synced iteration: the gradients were reduced (an optimizer step follows)."""


@dataclass(frozen=True)
class JoinRound:
    """What one iteration's message said: who trains, and what they will do."""

    world_size: int
    training: list[int]
    """The ranks that have a batch for this iteration."""
    plan: list[int]
    """The training ranks' plan flags (the joinable's own layout; zeros if none trains)."""
    cannot_shadow: list[int] = field(default_factory=list)
    """Ranks out of batches that cannot take part in the training ranks' iterations (a
    ZeroRedundancyOptimizer shards their model: its step is a collective too)."""

    @property
    def authority(self) -> int:
        """The rank whose buffers count: the highest still training (torch's choice)."""
        return max(self.training)

    def out_of_batches(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.training]


class JoinConfig(NamedTuple):
    """How a joinable behaves inside a `Join` (torch's `_JoinConfig` fields)."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool

    @staticmethod
    def disabled() -> JoinConfig:
        return JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class JoinHook:
    """torch's two entry points: `main_hook` per shadowed iteration, `post_hook` at the end."""

    plan_size = 0
    """How many plan flags the message carries for this hook's joinable (first one only)."""

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks still training."""

    def shadow(self, round_: JoinRound, send_local: bool) -> bool:
        """Shadow the iteration `round_` describes; by default, torch's `main_hook()`.

        True when gradients were reduced in it (a synced iteration)."""
        self.main_hook()
        return False

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has run out; `is_last_joiner`: this rank was among the last."""


class Joinable(ABC):
    """What `Join` needs of an object: a hook, and where its message travels."""

    _join_config: JoinConfig

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook: ...

    @property
    @abstractmethod
    def join_device(self) -> torch.device: ...

    @property
    @abstractmethod
    def join_process_group(self) -> dist.ProcessGroup: ...

    @property
    def shadows_its_collectives(self) -> bool:
        """False when a rank out of batches could not shadow every collective of a training
        iteration (a ZeroRedundancyOptimizer's all-gather after the step)."""
        return True


def exchange_round(
    joinable: Joinable,
    plan: list[int] | None,
    plan_size: int,
    stats: ReducerStats | None,
    can_shadow: bool = True,
) -> JoinRound:
    """One message: `plan` from a training rank, None from a rank out of batches (-1 in its
    slot when it cannot shadow the training ranks' iterations)."""
    group = joinable.join_process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    message = torch.zeros(world_size + plan_size, dtype=torch.int64)
    if plan is not None:
        message[rank] = 1
        message[world_size:] = torch.tensor(plan, dtype=torch.int64)
    elif not can_shadow:
        message[rank] = -1
    message = message.to(joinable.join_device)
    dist.all_reduce(message, group=group)
    if stats is not None:
        nbytes = message.numel() * message.element_size()
        stats.add(Traffic.of(Collective.ALL_REDUCE, world_size, other_bytes=nbytes))
    values = message.tolist()
    training = [r for r in range(world_size) if values[r] > 0]
    # Every training rank sends the same plan (they run the same program): sum / count.
    plan_sum = values[world_size:]
    plan_mean = [v // max(1, len(training)) for v in plan_sum]
    cannot = [r for r in range(world_size) if values[r] < 0]
    round_ = JoinRound(world_size, training, plan_mean, cannot)
    if cannot and training:  # every rank sees it in the same message: all raise together
        raise cannot_shadow(round_)
    return round_


class Join:
    """`with Join([model]):` around a loop whose ranks may have different numbers of batches.

    torch's arguments: `joinables` (phalanx DistributedDataParallel first),
    `enable`, `throw_on_early_termination`, and keyword arguments for the
    hooks (`divide_by_initial_world_size=True`).
    """

    def __init__(
        self,
        joinables: list[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        if not joinables:
            raise ConfigurationError(
                "Join needs at least one joinable — pass [model], the DistributedDataParallel"
            )
        for joinable in joinables:
            _check_joinable(joinable)
        self._joinables = joinables
        self._hooks = [j.join_hook(**kwargs) for j in joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        first = joinables[0]
        self._plan_size = self._hooks[0].plan_size
        self._stats: ReducerStats | None = getattr(getattr(first, "reducer", None), "stats", None)
        groups = {id(j.join_process_group) for j in joinables}
        if len(groups) > 1:
            raise ConfigurationError(
                "Join got joinables on different process groups — join those of one group"
            )
        self._first = first
        self._over = False  # a round with no rank training was seen: nothing left to shadow
        self._shadowed = False  # this rank shadowed at least one round (not a last joiner)

    def __enter__(self) -> Join:
        for k, joinable in enumerate(self._joinables):
            joinable._join_config = JoinConfig(self._enable, self._throw, is_first_joinable=k == 0)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Out of batches: shadow the others until no rank trains, then the post-hooks."""
        try:
            if not self._enable or exc_type is not None:
                return  # an error inside the loop propagates as it is (as in torch)
            while not self._over:
                self._shadow_on_exit()
            for hook in self._hooks:
                hook.post_hook(is_last_joiner=not self._shadowed)
        finally:
            for joinable in self._joinables:
                joinable._join_config = JoinConfig.disabled()

    def _shadow_on_exit(self) -> None:
        """torch's join: shadow the others' iterations; a ZeRO-sharded model cannot (its
        optimizer's all-gather would go unmatched), which every rank then hears of."""
        can = all(j.shadows_its_collectives for j in self._joinables)
        round_ = exchange_round(self._first, None, self._plan_size, self._stats, can)
        self._take_part(round_, send_local=False)

    def shadow_round(self, send_local: bool = False) -> Shadowed:
        """Take part in the training ranks' next iteration without a batch.

        `send_local=True` (phalanx) keeps this rank's `.grad` in the average and
        gives it the averaged gradients back, so that its optimizer can step with
        the others: the Trainer's `even_batches=False` does that for a rank whose
        epoch ended early, which keeps its optimizer state and step count in step.
        """
        round_ = exchange_round(self._first, None, self._plan_size, self._stats)
        return self._take_part(round_, send_local)

    def _take_part(self, round_: JoinRound, send_local: bool) -> Shadowed:
        if not round_.training:
            self._over = True
            return Shadowed.NOTHING_LEFT
        self._shadowed = True
        if self._throw:
            raise early_termination(round_)
        reduced = [hook.shadow(round_, send_local) for hook in self._hooks]
        return Shadowed.REDUCED if any(reduced) else Shadowed.FORWARD

    @staticmethod
    def notify_join_context(joinable: Joinable, plan: list[int]) -> JoinRound | None:
        """A training rank, before its iteration's collectives: send the message (first
        joinable only). Raises on every rank under throw_on_early_termination."""
        config = joinable._join_config
        if not config.enable or not config.is_first_joinable:
            return None
        stats = getattr(getattr(joinable, "reducer", None), "stats", None)
        round_ = exchange_round(joinable, plan, len(plan), stats)
        if config.throw_on_early_termination and len(round_.training) < round_.world_size:
            raise early_termination(round_)
        return round_


def cannot_shadow(round_: JoinRound) -> ConfigurationError:
    return ConfigurationError(
        f"rank(s) {round_.cannot_shadow} ran out of batches under Join while a "
        "ZeroRedundancyOptimizer shards the model: a rank without a batch cannot take part in "
        "the optimizer's parameter all-gather after the others' steps — give every rank the "
        "same number of batches (phalanx.DistributedSampler pads; the Trainer's "
        "even_batches=True), or use a plain optimizer with Join"
    )


def early_termination(round_: JoinRound) -> UnevenInputsError:
    ranks = round_.out_of_batches()
    return UnevenInputsError(
        f"rank(s) {ranks} ran out of batches while rank(s) {round_.training} still had some "
        "(Join(throw_on_early_termination=True) stops every rank here) — catch "
        "phalanx.UnevenInputsError to end the epoch, or give every rank the same number of "
        "batches (phalanx.DistributedSampler pads by default)"
    )


def _check_joinable(joinable: object) -> None:
    if isinstance(joinable, Joinable):
        return
    name = type(joinable).__name__
    if name == "ZeroRedundancyOptimizer":
        raise ConfigurationError(
            "ZeroRedundancyOptimizer cannot take part in a Join: a rank that ran out of "
            "batches still owns its shard of the optimizer state, which would have to step "
            "with the others' learning rate and clipping — give every rank the same number of "
            "batches (DistributedSampler pads; the Trainer's even_batches=True), or use a "
            "plain optimizer"
        )
    raise ConfigurationError(
        f"Join got a {name}, which is not a phalanx Joinable — pass the "
        "phalanx.DistributedDataParallel model (torch's own Joinables use torch's Join)"
    )
