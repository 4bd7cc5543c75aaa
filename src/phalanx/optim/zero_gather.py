"""ZeRO-1/2's step after the local one: every rank's updated pieces all-gathered, so every
replica is whole again.

The parameters are grouped by (device, dtype) into gathers of about 25 MB, so
the transient buffers stay small and one gather is in flight while the pieces
of the next are stepped. On gloo, parameters of 1 MiB or more are gathered by
broadcasting each rank's piece straight into the parameter's own storage (no
buffer, no copy: 15 ms against 21 for the 8.4M MLP at world 2); the others go
through a flat buffer, two of which are kept between steps (a buffer allocated
afresh each step cost 17 ms of page faults a step on that MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from phalanx.parallel.collectives import Pending, is_gloo, start_all_gather, start_broadcast_pieces
from phalanx.parallel.sharding import ShardedFlat
from phalanx.parallel.traffic import Collective, TimedWait, Traffic, TrafficCounter

GATHER_BUCKET_BYTES = 25 * 1024 * 1024
IN_PLACE_BYTES = 1024 * 1024


class GatherPlan(NamedTuple):
    """Parameters (indices) all-gathered together after a step, and how."""

    layout: ShardedFlat
    members: list[int]
    in_place: bool
    """gloo: each rank's piece of each parameter broadcast into place; else a flat buffer."""


class GatherInFlight(NamedTuple):
    """One plan's gather in flight: `out` is its flat buffer (None: broadcast in place)."""

    work: Pending
    plan: GatherPlan
    out: torch.Tensor | None


class ParameterGather:
    """The gathers of one ZeroRedundancyOptimizer's parameters, planned once."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup, stats: TrafficCounter
    ) -> None:
        self.params = list(params)
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.stats = stats
        self._buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self.plans = self._plan()

    def _plan(self) -> list[GatherPlan]:
        plans: list[GatherPlan] = []
        in_place_ok = is_gloo(self.group)
        open_lists: dict[tuple[torch.device, torch.dtype, bool], tuple[list[int], int]] = {}
        for i, p in enumerate(self.params):
            nbytes = p.numel() * p.element_size()
            key = (p.device, p.dtype, in_place_ok and nbytes >= IN_PLACE_BYTES)
            members, size = open_lists.get(key, ([], 0))
            members.append(i)
            size += nbytes
            if size >= GATHER_BUCKET_BYTES:
                plans.append(self._plan_of(members, key[2]))
                members, size = [], 0
            open_lists[key] = (members, size)
        for (*_, in_place), (members, _) in open_lists.items():
            if members:
                plans.append(self._plan_of(members, in_place))
        return plans

    def _plan_of(self, members: list[int], in_place: bool) -> GatherPlan:
        layout = ShardedFlat.of([self.params[i] for i in members], self.world_size, self.rank)
        return GatherPlan(layout, members, in_place)

    def run(
        self, shards: Sequence[torch.Tensor], step: Callable[[GatherPlan], None] | None
    ) -> None:
        """Gather every plan; `step(plan)` first steps that plan's pieces, so each gather
        runs while the next pieces are computed. Two gathers at most are in flight."""
        in_flight: list[GatherInFlight] = []
        for k, plan in enumerate(self.plans):
            if step is not None:
                step(plan)
            in_flight.append(self._start(k, plan, shards))
            if len(in_flight) > 1:
                self._finish(in_flight.pop(0))
        for entry in in_flight:
            self._finish(entry)

    def _start(self, k: int, plan: GatherPlan, shards: Sequence[torch.Tensor]) -> GatherInFlight:
        if plan.in_place:  # every piece broadcast straight into its parameter: no copies
            flats = [self.params[i].detach().view(-1) for i in plan.members]
            work = start_broadcast_pieces(flats, plan.layout, self.group)
            self.stats.add(plan.layout.gather_traffic(self.world_size))
            return GatherInFlight(work, plan, None)
        out = self._buffer(plan.layout, k)  # plan k-2's gather is done by now
        block = plan.layout.own_block_input([shards[i] for i in plan.members], out)
        state = start_all_gather(out, block, self.group)
        self.stats.add(
            Traffic.of_tensor(Collective.ALL_GATHER, out, self.world_size, gradients=False)
        )
        return GatherInFlight(state.work, plan, out)

    def _finish(self, gather: GatherInFlight) -> None:
        plan, out = gather.plan, gather.out
        with TimedWait() as waited:
            gather.work.wait()
        self.stats.add(waited.traffic())
        if out is not None:
            with torch.no_grad():
                plan.layout.copy_out(out, [self.params[i] for i in plan.members])

    def _buffer(self, layout: ShardedFlat, slot: int) -> torch.Tensor:
        """An output for `layout`, from two kept buffers per (device, dtype), each the size of
        the largest such gather."""
        key = (layout.device, layout.dtype, slot % 2)
        size = max(
            p.layout.world_size * p.layout.block
            for p in self.plans
            if p.layout.dtype == layout.dtype and not p.in_place
        )
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=layout.dtype, device=layout.device)
            self._buffers[key] = buffer
        return buffer[: layout.world_size * layout.block]
