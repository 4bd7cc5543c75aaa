"""Which configuration to train with: the fastest predicted one that fits the budget.

The candidates are every stage the world allows, in memory or with a disk
offload of 1/4, 1/2, 3/4 or all of the offloadable state (stages 1-3; at stage 3
on a CUDA device also FSDP2's CPU offload), and every micro-batch that divides
a rank's share of the global batch, the accumulation making up the rest (the
global batch, and so the training, is the same in all of them). A candidate
fits when its predicted peak, with `headroom` to spare, is within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.errors import ConfigurationError
from phalanx.train.plan.count import ModelCount
from phalanx.train.plan.predict import Config, Parts, predict_memory, predict_step_s
from phalanx.train.plan.probe import Rates

__all__ = ["Candidate", "Choice", "NothingFits", "candidates", "choose"]

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
HEADROOM = 0.05
"""The share of the budget left unplanned: the predictions' error measured over the grid
(docs/planner.md) stays inside it."""
TIME_SLACK = 0.1
"""Step times predicted within this share of the fastest are a tie (the probe's rates move
by more than that on a loaded machine): the simplest of them is chosen."""


class NothingFits(ConfigurationError):
    """No configuration fits the budget (the message names the smallest that would)."""


@dataclass(frozen=True)
class Candidate:
    config: Config
    memory: Parts
    step_s: float
    fits: bool


@dataclass(frozen=True)
class Choice:
    """The chosen candidate, the budget it was chosen for, and every candidate weighed."""

    chosen: Candidate
    budget: float
    budget_source: str
    candidates: tuple[Candidate, ...]


def micro_batches(per_rank: int) -> list[int]:
    """Every divisor of `per_rank`, largest first."""
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


Allowed = Sequence[tuple[int, str]]
"""(stage, offload tier) pairs a plan may choose among."""
EVERYTHING: Allowed = tuple((s, t) for s in (0, 1, 2, 3) for t in ("none", "disk", "cpu"))


def candidates(
    world: int,
    per_rank: int,
    cuda: bool,
    allowed: Allowed = EVERYTHING,
    keep_gathered: bool = False,
) -> list[Config]:
    """Every configuration worth predicting (see the module doc) among `allowed`
    (`keep_gathered`: stage 3's units stay gathered from forward to backward)."""
    out: list[Config] = []
    for stage, tier in allowed:
        if stage in (1, 2) and world == 1:
            continue  # one rank: stages 1-2 shard nothing that stage 0 keeps whole
        if (tier != "none" and stage == 0) or (tier == "cpu" and not (stage == 3 and cuda)):
            continue  # stage 0 offloads nothing; the CPU tier is a device's (the host is ours)
        fractions = FRACTIONS if tier == "disk" else (1.0 if tier == "cpu" else 0.0,)
        for fraction in fractions:
            for m in micro_batches(per_rank):
                kept = keep_gathered and stage == 3
                config = Config(stage, tier, fraction, m, per_rank // m, keep_gathered=kept)  # type: ignore[arg-type]
                out.append(config)
    return out


def choose(
    count: ModelCount,
    rates: Rates,
    world: int,
    global_batch: int,
    budget: float,
    budget_source: str,
    cuda: bool = False,
    allowed: Allowed = EVERYTHING,
    configs: Sequence[Config] | None = None,
    keep_gathered: bool = False,
) -> Choice:
    """The fastest configuration that fits `budget` bytes per rank (among `configs` if given,
    else every candidate `allowed`); NothingFits, naming the smallest budget that would fit
    and what it would take, if none does."""
    if global_batch % world:
        raise ConfigurationError(
            f"the global batch ({global_batch}) does not divide among {world} ranks — make it "
            f"a multiple of {world}"
        )
    weighed = []
    if configs is None:
        configs = candidates(world, global_batch // world, cuda, allowed, keep_gathered)
    if not configs:
        raise ConfigurationError("no stage and offload to plan among — allow zero_stage 1-3")
    for config in configs:
        memory = predict_memory(config, count, world, rates)
        step = predict_step_s(config, count, rates, world)
        fits = memory.total <= budget * (1 - HEADROOM)
        weighed.append(Candidate(config, memory, step, fits))
    fitting = [c for c in weighed if c.fits]
    if not fitting:
        smallest = min(weighed, key=lambda c: c.memory.total)
        need = smallest.memory.total / (1 - HEADROOM)
        raise NothingFits(
            f"no configuration fits {_size(budget)} per rank ({budget_source}) — the smallest "
            f"needs {_size(need)}: {smallest.config.describe()}; give each rank that much, or "
            "add ranks"
        )
    fastest = min(c.step_s for c in fitting)
    tied = [c for c in fitting if c.step_s <= fastest * (1 + TIME_SLACK)]
    return Choice(min(tied, key=_simplicity), budget, budget_source, tuple(weighed))


def _simplicity(candidate: Candidate) -> tuple[float, ...]:
    """Fewer moving parts first: a lower stage, no offload, less in files, fewer micro-batches."""
    config = candidate.config
    tier = ("none", "cpu", "disk").index(config.offload)
    return (config.stage, tier, config.fraction, config.accumulation, candidate.step_s)


def _size(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GB"
    return f"{nbytes / 2**20:.0f} MB"
