"""The reducer's buckets as one set: built as the plan lays them out, reduced together.

The set holds which bucket and slot each parameter's gradient goes to, the
reduction every bucket goes through (and the scale it asks of the hook path),
and what is done to all buckets at once at the end of backward: wait for each
launched one, booking what it sent, and hand the reduced gradients over. The
reducer (phalanx.ddp.reducer) decides when; the set knows how.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.ddp.buckets import Bucket
from phalanx.ddp.reductions import BucketReduction
from phalanx.ground import progress_record
from phalanx.parallel.traffic import ReducerStats

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline


class BucketSet:
    """Every bucket of one reducer, and the reduction they all go through."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        world_size: int,
        reduction: BucketReduction[Any],
        *,
        grads_in_views: bool,
        deferred: bool,
    ) -> None:
        self.params = params
        self.world_size = world_size
        self.reduction = reduction
        self.grads_in_views = grads_in_views
        """gradient_as_bucket_view: `.grad` lives in its bucket slot."""
        self.deferred = deferred
        """batched_grad_copy: slots are filled at launch, not as each gradient arrives."""
        self.buckets: list[Bucket] = []
        self.bucket_of: list[Bucket] = []
        """Per parameter (reducer index), the bucket its gradient goes to."""
        self.slot_of: list[int] = []
        """Per parameter, its slot in that bucket."""
        self.next_launch = 0
        """The first bucket not launched yet in this iteration: launches go strictly in
        bucket order, so every rank issues the same collectives."""

    def build(self, assignment: Sequence[Sequence[int]]) -> None:
        """(Re)allocate the buckets, parameter indices per bucket in launch order."""
        last = len(assignment) - 1
        keeps_gradients = self.reduction.keeps_gradients
        self.buckets = [
            Bucket(
                k,
                list(indices),
                self.params,
                is_last=k == last,
                flag_slots=self.world_size if k == last else 0,
                grads_in_views=self.grads_in_views,
                keeps_gradients=keeps_gradients,
                deferred=self.deferred,
            )
            for k, indices in enumerate(assignment)
        ]
        self.bucket_of = [self.buckets[0]] * len(self.params)
        self.slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i], self.slot_of[i] = bucket, slot
        self._apply_scale()
        if self.grads_in_views and keeps_gradients:
            for bucket in self.buckets:
                bucket.bind_grads_to_views()

    def set_reduction(self, reduction: BucketReduction[Any]) -> bool:
        """Every bucket goes through `reduction` from now on, with the divisor the last one
        had; True when the buckets must be built again (it keeps gradients, or stops)."""
        rebuild = reduction.keeps_gradients != self.buckets[0].keeps_gradients
        reduction.set_divisor(self.reduction.divisor)
        self.reduction = reduction
        if not rebuild:
            self._apply_scale()
        return rebuild

    def _apply_scale(self) -> None:
        scale = self.reduction.slot_scale()
        for bucket in self.buckets:
            bucket.scale = scale

    def start_iteration(self) -> None:
        self.next_launch = 0
        self.reduction.start_iteration()
        for bucket in self.buckets:
            bucket.reset()

    def launch_ready(
        self, skipped: frozenset[int], stats: ReducerStats, timeline: Timeline | None
    ) -> None:
        """Launch every consecutive full bucket from `next_launch` (a skipped one is only
        counted: no rank used it)."""
        buckets, k = self.buckets, self.next_launch
        while k < len(buckets) and buckets[k].pending == 0:
            if k in skipped:
                stats.buckets_skipped += 1
            else:
                bucket = buckets[k]
                bucket.launch(self.reduction)
                progress_record.collective("ddp all_reduce bucket", k, stats.sync_rounds + 1)
                stats.buckets_launched += 1
                if timeline is not None and bucket.work is not None:
                    timeline.bucket_launched(k, bucket.grad_bytes, bucket.work.future())
            k += 1
        self.next_launch = k

    def slot_view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s slot in its bucket."""
        return self.bucket_of[i].views[self.slot_of[i]]

    def flag_carrier(self, skipped: frozenset[int]) -> torch.Tensor | None:
        """The last bucket's flag slots, when the flags ride in its collective."""
        last = len(self.buckets) - 1
        if self.reduction.carries_flags and last not in skipped:
            return self.buckets[last].flags
        return None

    def wait_all(self, stats: ReducerStats, write_back: frozenset[int] | None) -> None:
        """Every launched bucket's collective done and what each sent booked in `stats`;
        given `write_back` (the skipped buckets), each other bucket's gradients are handed
        over as soon as it is done."""
        for bucket in self.buckets:
            in_flight = bucket.work
            if in_flight is not None:
                bucket.wait()
                stats.add(in_flight.traffic(bucket, self.world_size))
                stats.hook_bytes = self.reduction.traffic_source
            if write_back is not None and bucket.index not in write_back:
                self.reduction.write_back(bucket, set())

    def write_back(self, skipped: frozenset[int], unused_everywhere: set[int]) -> None:
        """Hand every sent bucket's reduced gradients over, except the parameters unused on
        every rank."""
        for bucket in self.buckets:
            if bucket.index not in skipped:
                self.reduction.write_back(bucket, unused_everywhere)
