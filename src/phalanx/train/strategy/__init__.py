"""The run's data-parallel strategy, chosen once from `zero_stage`: the Trainer asks it and
never branches on the stage (torchtitan's `parallelize_*` idea). base.py says what every
strategy answers; choice.py which optimizer the user brought."""

from __future__ import annotations

from phalanx.diagnostics.timeline import Timeline
from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.train.config.args import TrainingArguments
from phalanx.train.strategy.base import Strategy
from phalanx.train.strategy.choice import OptimizerChoice
from phalanx.train.strategy.fully_shard import FullyShard
from phalanx.train.strategy.sharded import ShardedGradients, ShardedOptimizer

__all__ = [
    "FullyShard",
    "OptimizerChoice",
    "ShardedGradients",
    "ShardedOptimizer",
    "Strategy",
    "strategy_for",
]

_BY_STAGE: dict[int, type[Strategy]] = {
    0: Strategy,
    1: ShardedOptimizer,
    2: ShardedGradients,
    3: FullyShard,
}


def strategy_for(
    args: TrainingArguments,
    world: World,
    choice: OptimizerChoice | None = None,
    timeline: Timeline | None = None,
) -> Strategy:
    """The one place that reads zero_stage to decide how the run is data-parallel. "auto"
    never reaches it: the Trainer plans first (phalanx.train.plan) and makes the strategy
    from the plan's arguments."""
    if args.plans_memory():
        raise ConfigurationError(
            f"zero_stage={args.zero_stage!r}, zero_offload={args.zero_offload!r}: 'auto' is "
            "resolved by the Trainer's planner before a strategy is made — make the strategy "
            "from phalanx.train.plan.resolve's arguments (the Trainer does)"
        )
    return _BY_STAGE[int(args.zero_stage)](args, world, choice, timeline)
