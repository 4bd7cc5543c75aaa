"""`bucket_cap_mb="auto"`: try a few bucket sizes on the real job during its first steps,
then keep the fastest, once and identically on every rank.

Why measure instead of model: the best size depends on how backward's compute
and the collectives share the machine (on CPUs, gloo's threads take cores
from backward; on GPUs, NCCL kernels share the SMs), which a latency/bandwidth
model of the network does not see. So each candidate runs for a few synced
steps on the job itself, and what is timed is exactly what the bucket size
changes: from the first gradient of backward to the end of the reduction
(backward's compute plus the communication it could not hide).

The schedule (docs/ddp.md): candidates whose bucket layout is the same for
this model are tried once; each candidate gets `SETTLE_STEPS` untimed steps
(its buffers' first use) and `TIMED_STEPS` timed ones, and the whole round is
run `PASSES` times, so slow drift in machine load hits every candidate alike.
Each rank takes the median of its timings per candidate, the slowest rank's
median counts (it sets the pace), rank 0 picks the smallest and broadcasts
its choice. The steps are counted in synced iterations, trained or shadowed
under Join, which every rank counts alike: a rank that ran out of batches
switches and decides in step with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.ddp.buckets import MIB, default_caps
from phalanx.ddp.stats import Collective, ReducerStats, Traffic

CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)
"""torch's default (25) and the sizes around it that people set by hand."""
SETTLE_STEPS = 1
TIMED_STEPS = 2
PASSES = 2
_NO_TIMING = -1.0


class BucketSizeTuner:
    """Which bucket caps the next synced iteration uses, until the choice is made."""

    def __init__(self, candidates_mb: Sequence[float] = CANDIDATES_MB) -> None:
        self.candidates_mb = list(candidates_mb)
        self.candidates = [default_caps(int(mb * MIB)) for mb in self.candidates_mb]
        self.chosen_mb: float | None = None
        """The size kept, once decided."""
        self.timings: dict[float, list[float]] = {}
        """Seconds of backward + reduction per timed step, by candidate size (this rank)."""
        self._plan: list[tuple[int, bool]] = []  # (candidate, timed) per synced iteration
        self._step = -1  # index into _plan of the iteration running now
        self._started = False

    @property
    def done(self) -> bool:
        return self.chosen_mb is not None

    def initial_caps(self) -> list[int]:
        """What the buckets use until the measurement starts (the default size)."""
        return default_caps(int(25 * MIB))

    def next_caps(
        self,
        layout_of: Callable[[list[int]], list[list[int]]],
        group: dist.ProcessGroup,
        device: torch.device,
        stats: ReducerStats,
    ) -> list[int] | None:
        """Before a synced iteration (every rank, in step): new caps to build now, or None.

        `layout_of(caps)` is the bucket assignment those caps give (to try each
        distinct layout once). The last call decides, with two small collectives.
        """
        if not self._started:
            self._started = True
            self._plan = self._make_plan(layout_of)
        self._step += 1
        if self._step >= len(self._plan):
            best = self._decide(group, device, stats)
            self.chosen_mb = self.candidates_mb[best]
            return self.candidates[best]
        candidate, _ = self._plan[self._step]
        previous = self._plan[self._step - 1][0] if self._step > 0 else None
        return self.candidates[candidate] if candidate != previous else None

    def record(self, seconds: float) -> None:
        """The iteration that just ended took `seconds` of backward and reduction."""
        if self.done or not 0 <= self._step < len(self._plan):
            return
        candidate, timed = self._plan[self._step]
        if timed:
            self.timings.setdefault(self.candidates_mb[candidate], []).append(seconds)

    def _make_plan(
        self, layout_of: Callable[[list[int]], list[list[int]]]
    ) -> list[tuple[int, bool]]:
        distinct: list[int] = []
        seen: list[list[list[int]]] = []
        for k, caps in enumerate(self.candidates):
            layout = layout_of(caps)
            if layout not in seen:
                seen.append(layout)
                distinct.append(k)
        if len(distinct) == 1:
            return []  # one layout whatever the size: nothing to measure
        one_pass = [
            step
            for k in distinct
            for step in [(k, False)] * SETTLE_STEPS + [(k, True)] * TIMED_STEPS
        ]
        return one_pass * PASSES

    def _decide(self, group: dist.ProcessGroup, device: torch.device, stats: ReducerStats) -> int:
        """Slowest rank's median per candidate; rank 0 picks the fastest and tells everyone."""
        medians = [
            statistics.median(self.timings[mb]) if self.timings.get(mb) else _NO_TIMING
            for mb in self.candidates_mb
        ]
        slowest = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        timed = [(t, k) for k, t in enumerate(slowest.tolist()) if t != _NO_TIMING]
        default = self.candidates_mb.index(25.0) if 25.0 in self.candidates_mb else 0
        choice = torch.tensor([min(timed)[1] if timed else default], device=device)
        dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
        world_size = dist.get_world_size(group)
        stats.add(Traffic.of(Collective.ALL_REDUCE, world_size, other_bytes=slowest.nbytes))
        stats.add(Traffic.of(Collective.BROADCAST, world_size, other_bytes=choice.nbytes))
        return int(choice.item())
