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
median counts (it sets the pace), and rank 0 picks the smallest, but leaves
the default layout (25 MiB's) only for a size at least `MARGIN` faster: the
candidates of most models lie within a few percent of each other, where a
handful of timed steps on a busy machine would pick at random. It broadcasts
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
from phalanx.parallel.traffic import Collective, ReducerStats, Traffic

CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)
"""torch's default (25) and the sizes around it that people set by hand."""
DEFAULT_MB = 25.0
SETTLE_STEPS = 1
TIMED_STEPS = 2
PASSES = 2
MARGIN = 0.03
"""How much faster than the default layout another size must measure to replace it:
the run-to-run spread of one size's median on the 2-core machine (docs/performance.md)."""
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
        self._default = 0  # the timed candidate whose layout is the default size's
        self._step = -1  # index into _plan of the iteration running now
        self._started = False

    @property
    def done(self) -> bool:
        return self.chosen_mb is not None

    def initial_caps(self) -> list[int]:
        """What the buckets use until the measurement starts (the default size)."""
        return default_caps(int(DEFAULT_MB * MIB))

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
        default = layout_of(self.initial_caps())
        self._default = distinct[seen.index(default)] if default in seen else distinct[0]
        if len(distinct) == 1:
            return []  # one layout whatever the size: nothing to measure
        one_pass = [
            step
            for k in distinct
            for step in [(k, False)] * SETTLE_STEPS + [(k, True)] * TIMED_STEPS
        ]
        return one_pass * PASSES

    def _decide(self, group: dist.ProcessGroup, device: torch.device, stats: ReducerStats) -> int:
        """Slowest rank's median per candidate; rank 0 picks and tells everyone."""
        medians = [
            statistics.median(self.timings[mb]) if self.timings.get(mb) else _NO_TIMING
            for mb in self.candidates_mb
        ]
        slowest = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        choice = torch.tensor([self.pick(slowest.tolist())], device=device)
        dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
        world_size = dist.get_world_size(group)
        stats.add(Traffic.of(Collective.ALL_REDUCE, world_size, other_bytes=slowest.nbytes))
        stats.add(Traffic.of(Collective.BROADCAST, world_size, other_bytes=choice.nbytes))
        return int(choice.item())

    def pick(self, seconds: Sequence[float]) -> int:
        """The candidate to keep, from each one's time (`_NO_TIMING`: not measured): the
        fastest if it beats the default layout's by `MARGIN`, else the default's."""
        timed = [(t, k) for k, t in enumerate(seconds) if t != _NO_TIMING]
        if not timed:
            return self._default
        fastest, k = min(timed)
        reference = seconds[self._default]
        if reference == _NO_TIMING or fastest < reference * (1 - MARGIN):
            return k
        return self._default
