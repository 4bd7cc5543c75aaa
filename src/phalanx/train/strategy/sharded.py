"""Stages 1 and 2: the optimizer's state (and at stage 2 the gradients) cut in N pieces."""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.ddp.module import DistributedDataParallel
from phalanx.errors import ConfigurationError
from phalanx.offload import DiskOffloadPolicy, streamer_of
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.optim.zero_state import Assembly
from phalanx.parallel.traffic import Traffic
from phalanx.train.strategy.base import Strategy

__all__ = ["ShardedGradients", "ShardedOptimizer"]


class ShardedOptimizer(Strategy):
    """Stage 1: a ZeroRedundancyOptimizer over the same groups, built after the model is
    wrapped (and handed the wrapper: stage 2 reduce-scatters through its reducer).

    A world of one runs it too, with one shard: its checkpoints then have the
    sharded layout, so a one-process run and a many-rank run resume each
    other's. Stage 2 there is stage 1: with no reducer there is nothing to
    reduce-scatter, and the single shard is the whole gradient. A user's
    optimizer (`optimizer=`, `optimizers=`, `optimizer_cls_and_kwargs=`) is
    sharded the same way: its class and each group's options, rebuilt over the
    pieces, before it has any state.
    """

    shards_state = True

    shards_gradients = False
    """Stage 2: the reducer reduce-scatters each bucket into the optimizer's shards."""

    def build_optimizer(self, model: nn.Module) -> Optimizer:
        """Handed the DDP wrapper explicitly: stage 2 reduce-scatters through its reducer."""
        given = self._user_optimizer(model)
        if given is not None:
            cls, groups, settings = type(given), _fresh_groups(given), _options(given)
        else:
            cls, groups, settings = self._recipe(model)
        disk = self.offload
        wrapped = self.wrapped
        return ZeroRedundancyOptimizer(
            groups,
            cls,
            process_group=self.world.process_group,
            shard_gradients=self.shards_gradients and self.world.is_distributed,
            offload_policy=disk if isinstance(disk, DiskOffloadPolicy) else None,
            ddp_model=wrapped if isinstance(wrapped, DistributedDataParallel) else None,
            **settings,
        )

    def live_pieces(self, optimizer: Optimizer, copy: bool = True) -> dict[str, Tensor]:
        return _zero(optimizer).own_pieces(copy)

    def live_groups(self, optimizer: Optimizer) -> list[dict[str, object]]:
        return _zero(optimizer).pieces().plain_groups()

    def live_assembly(self, optimizer: Optimizer, rank: int, world_size: int) -> Assembly:
        """The whole of every tensor: the parameters are replicated, and the new world's
        ZeroRedundancyOptimizer takes its pieces from the whole state."""
        return Assembly(_zero(optimizer).pieces().shapes)

    def live_restore(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        assembly: Assembly,
        groups: list[dict[str, object]],
    ) -> Optimizer:
        """The parameters whole again from the old world's pieces, and a ZeroRedundancyOptimizer
        of the new world (over the rewrapped model) loaded with the whole state: each rank
        keeps its new pieces. The old one's offload streamer is closed (its files stay)."""
        old = _zero(optimizer)
        whole = old.restore_whole(assembly, [dict(g) for g in groups])
        streamer = streamer_of(old.optim)
        if streamer is not None:
            streamer.close()
        fresh = self.build_optimizer(model)
        fresh.load_state_dict(whole)
        return fresh

    def clip(self, model: nn.Module, optimizer: Optimizer, max_norm: float) -> Tensor:
        """The norm from the shards (one all-reduce): under stage 2 no rank holds the whole
        gradient that torch's clip would read."""
        return _zero(optimizer).clip_grad_norm_(max_norm)

    def traffic(self, optimizer: Optimizer, periodic_sync: PeriodicSync | None) -> Traffic:
        """The reducer's (stage 2: its reduce-scatters) and the optimizer's parameter
        all-gathers after each step."""
        total = super().traffic(optimizer, periodic_sync)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            total += optimizer.stats.traffic
        return total


class ShardedGradients(ShardedOptimizer):
    """Stage 2: stage 1, and each bucket is reduce-scattered, so a rank keeps 1/N of the
    gradients too."""

    shards_gradients = True


def _zero(optimizer: Optimizer) -> ZeroRedundancyOptimizer:
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer


def _fresh_groups(optimizer: Optimizer) -> list[dict[str, object]]:
    """The user's groups, each with its options, for ZeRO to shard; one line if the optimizer
    has state already (it would be lost: ZeRO makes the state of its own pieces)."""
    if any(optimizer.state.values()):
        raise ConfigurationError(
            f"your {type(optimizer).__name__} has stepped already: ZeRO shards an optimizer "
            "before its first step (its state is made per piece) — pass one that has not "
            "stepped, or optimizer_cls_and_kwargs=(cls, kwargs)"
        )
    return [dict(group) for group in optimizer.param_groups]


def _options(optimizer: Optimizer) -> dict[str, Any]:
    """The user's optimizer's defaults that its class takes as arguments (torch keeps some
    defaults its constructor does not accept, such as AdamW's decoupled_weight_decay)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
