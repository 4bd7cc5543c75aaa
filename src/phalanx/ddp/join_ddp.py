"""DistributedDataParallel's side of `Join`: what a training rank announces, and what a
rank out of batches does in its place (phalanx.ddp.join holds the protocol).

A training rank's forward sends three plan flags (`ForwardPlan`); a rank out of
batches reads them and issues the same collectives in the same order:
bucket rebuild (rank 0's arrival order, and bucket_cap_mb="auto"'s switch),
buffer broadcast from the highest rank still training, and, for a synced
forward, the whole reduction with no gradient of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from phalanx.ddp.join import Join, Joinable, JoinHook, JoinRound
from phalanx.ddp.reducer import Reducer
from phalanx.parallel.sync import broadcast_coalesced

if TYPE_CHECKING:
    from phalanx.ddp.module import DistributedDataParallel


@dataclass(frozen=True)
class ForwardPlan:
    """What the training ranks' next forward does, as the Join message carries it."""

    sync: bool
    """Grad-enabled and synced: its backward reduces the buckets."""
    buffers: bool
    """It broadcasts the buffers first."""
    rebuild: bool
    """It takes rank 0's arrival order for the buckets first (once)."""

    SIZE = 3

    def flags(self) -> list[int]:
        return [int(self.sync), int(self.buffers), int(self.rebuild)]

    @classmethod
    def of(cls, round_: JoinRound) -> ForwardPlan:
        sync, buffers, rebuild = (bool(v) for v in round_.plan[: cls.SIZE])
        return cls(sync, buffers, rebuild)


class DDPJoinHook(JoinHook):
    """torch's `_DDPJoinHook`: shadow one forward + backward; at the end, sync the model."""

    plan_size = ForwardPlan.SIZE

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def shadow(self, round_: JoinRound, send_local: bool) -> bool:
        ddp, plan = self.ddp, ForwardPlan.of(round_)
        ddp.set_join_divisor(round_)
        if plan.sync:
            ddp.reducer.before_sync_forward(plan.rebuild)
        if plan.buffers:
            ddp.sync_buffers(src=round_.authority)
        ddp.require_forward_param_sync = plan.sync
        if plan.sync:
            ddp.reducer.shadow_iteration(send_local=send_local)
        return plan.sync

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters and buffers of the highest last joiner (torch)."""
        ddp = self.ddp
        group = ddp.process_group
        candidate = dist.get_rank(group) if is_last_joiner else -1
        src = ddp.reducer.signals.agree_max(candidate)
        state: list[torch.Tensor] = [p for _, p in ddp._managed_parameters()]
        if ddp.forward_sync_buffers:
            state += ddp._buffers_to_sync
        ddp.reducer.stats.add(broadcast_coalesced(state, group, src=src))
        ddp.reducer.average_over(dist.get_world_size(group))


class JoinableDDP(Joinable):
    """Mixed into DistributedDataParallel: `model.join()` and what `Join` asks of it."""

    reducer: Reducer
    process_group: dist.ProcessGroup
    _divide_by_initial_world_size: bool

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """`with model.join():` — the same as `with phalanx.Join([model], ...)` (torch's)."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What this model does on a rank out of batches (DDPJoinHook)."""
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        self._divide_by_initial_world_size = divide
        return DDPJoinHook(cast("DistributedDataParallel", self), divide)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.signals.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @property
    def shadows_its_collectives(self) -> bool:
        """Not when a ZeroRedundancyOptimizer steps this model's pieces: its all-gather."""
        return self.reducer.sharded_by() is None

    def set_join_divisor(self, round_: JoinRound) -> None:
        """divide_by_initial_world_size=False: average over the ranks training this round."""
        if not self._divide_by_initial_world_size:
            self.reducer.average_over(len(round_.training))
