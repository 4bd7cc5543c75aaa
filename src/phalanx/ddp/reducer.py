"""The gradient reducer: routes each gradient to its bucket and drives one iteration.

Life of one synced iteration (docs/architecture.md draws it):
  forward  -> `prepare_for_backward` arms the reducer; with unused-parameter
              tracking, `UnusedParameters` lists what the graph misses;
  backward -> each parameter's hook marks it ready in its `Bucket`; a full
              bucket is launched through the `BucketReduction`, strictly in
              bucket order so every rank issues the same collectives;
  end      -> `_finalize` (run by the autograd engine when the outermost
              backward through this forward ends, phalanx.ddp.autograd)
              waits for every bucket, exchanges the `StepSignals` (failure
              flags, used map) and writes the reduced gradients to `.grad`.
With static_graph, the first synced backward only counts gradients per
parameter (phase RECORDING, phalanx.ddp.static_graph) and sends every bucket
at its end. The hook runs once per parameter per step in Python, so it is
kept minimal.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.ddp import reducer_errors
from phalanx.ddp.autograd import EndOfBackward
from phalanx.ddp.buckets import Bucket, assign_buckets
from phalanx.ddp.reductions import AllReduce, BucketReduction
from phalanx.ddp.signals import StepSignals
from phalanx.ddp.static_graph import GradientCounts
from phalanx.ddp.sync import rank0_order
from phalanx.ddp.unused import UnusedParameters
from phalanx.diagnostics import progress

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline


class Phase(Enum):
    """Where the reducer stands in the current iteration."""

    IDLE = "idle"
    """No DDP forward since the last reduction: gradients are ignored."""
    LOCAL_ARMED = "local_armed"
    """A forward ran under no_sync(): its backward only accumulates."""
    LOCAL = "local"
    """A no_sync() backward is running."""
    ARMED = "armed"
    """A synced forward ran: its backward will reduce."""
    REDUCING = "reducing"
    """A synced backward is running: buckets fill and launch in order."""
    RECORDING = "recording"
    """static_graph's first synced backward: gradients are only counted; every bucket
    goes at its end (torch's DDP does the same)."""
    REDUCED = "reduced"
    """Reduced: another gradient before the next forward is an error."""


# The hook compares against this module constant: no attribute lookup on Phase per call.
_REDUCING = Phase.REDUCING


@dataclass
class ReducerStats:
    """Counters a user (or a test) can read to see what the reducer really did."""

    sync_rounds: int = 0  # backward passes whose gradients were reduced
    buckets_launched: int = 0  # bucket collectives launched
    buckets_skipped: int = 0  # not sent, unused on every rank (skip_all_reduce_unused_params)
    collectives: int = 0  # every collective launched for gradients (buckets + step signals)
    comm_wait_s: float = 0.0  # time spent waiting on communication at the end of backward
    rebuilds: int = 0  # bucket rebuilds (at most one)


class Reducer:
    """Averages the gradients of `named_params` across `group` during backward."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup,
        bucket_caps: Sequence[int],
        *,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        skip_unused_buckets: bool = False,
        batched_copy: bool = False,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_caps = list(bucket_caps)
        """Bucket k of a (device, dtype) closes at bucket_caps[k] bytes (the last cap repeats)."""
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_unused_buckets = skip_unused_buckets
        """skip_all_reduce_unused_params: a bucket unused on every rank is not sent."""
        self.batched_copy = batched_copy
        self.stats = ReducerStats()
        self.timeline: Timeline | None = None
        """Where backward, bucket flights and the final wait are recorded (None: nowhere)."""
        self.reduction: BucketReduction = AllReduce(group)
        self.unused = UnusedParameters(self.params, find_unused_parameters, static_graph)
        self.counts = GradientCounts(self.names, static_graph)
        self.signals = StepSignals(group, self.params[0].device)
        self.phase = Phase.IDLE
        self._end = EndOfBackward(self._end_of_backward)
        self._used = self.unused.used  # the same bytearray, reset in place
        # Per parameter, gradients still to come before it is ready (0: ready). 1 each,
        # except under static_graph for a parameter used by several reentrant checkpoints.
        self._fires_left = bytearray(self.counts.expected)
        self._next_launch = 0
        self._skipped: frozenset[int] = frozenset()  # bucket indices not sent this iteration
        self._skip_planned_for: list[Bucket] | None = None
        self._backwards_seen = 0
        self._recording_arrival = False
        self._arrival: list[int] = []  # first backward's gradient order, for the rebuild
        self._rebuilt = False
        self._build(list(reversed(range(len(self.params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------- buckets
    def _build(self, order: list[int]) -> None:
        """(Re)allocate the buckets for arrival `order`, keeping any gradients already there."""
        assignment = assign_buckets(self.params, order, self.bucket_caps)
        last = len(assignment) - 1
        self.buckets = [
            Bucket(
                k,
                indices,
                self.params,
                is_last=k == last,
                flag_slots=self.world_size if k == last else 0,
                grads_in_views=self.gradient_as_bucket_view,
                keeps_gradients=self.reduction.keeps_gradients,
                deferred=self.batched_copy,
            )
            for k, indices in enumerate(assignment)
        ]
        self._bucket_of: list[Bucket] = [self.buckets[0]] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._bucket_of[i], self._slot_of[i] = bucket, slot
        self._skipped = frozenset()
        self.set_reduction(self.reduction)
        if self.gradient_as_bucket_view and self.reduction.keeps_gradients:
            for bucket in self.buckets:
                bucket.bind_grads_to_views()

    def _slot_view(self, i: int) -> torch.Tensor:
        return self._bucket_of[i].views[self._slot_of[i]]

    def set_reduction(self, reduction: BucketReduction) -> None:
        """Choose what a full bucket does (phalanx.ddp.reductions)."""
        rebuild = reduction.keeps_gradients != self.buckets[0].keeps_gradients
        self.reduction = reduction
        if rebuild:
            self._build([i for b in self.buckets for i in b.param_indices])
            return
        scale = reduction.slot_scale()
        for bucket in self.buckets:
            bucket.scale = scale

    def bucket_order(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for logs and tests)."""
        return [[self.names[i] for i in b.param_indices] for b in self.buckets]

    def rebuild_if_due(self) -> None:
        """Once, after the first backward: re-bucket in the order gradients really arrived.

        Rank 0's order is broadcast so that every rank builds identical buckets.
        """
        if self._rebuilt or self._backwards_seen == 0:
            return
        self._rebuilt = True
        self._recording_arrival = False
        # A parameter counted several times (static_graph's first backward) is ready at
        # its last gradient: keep that arrival.
        arrival = list(dict.fromkeys(reversed(self._arrival)))[::-1]
        seen = rank0_order(arrival, len(self.params), self.group, self.signals.device)
        seen_set = set(seen)
        new_order = seen + [i for i in reversed(range(len(self.params))) if i not in seen_set]
        self._arrival = []
        self.stats.rebuilds += 1
        new = assign_buckets(self.params, new_order, self.bucket_caps)
        if new != [b.param_indices for b in self.buckets]:
            self._build(new_order)

    def set_static_graph(self) -> None:
        """`_set_static_graph()`: from the next synced backward on, as static_graph=True."""
        if self._backwards_seen or self.phase is not Phase.IDLE:
            raise reducer_errors.static_graph_too_late()
        self.counts.start_recording()
        self.unused.make_static()

    def check_finalized(self) -> None:
        """`_check_reducer_finalized()`: the last synced backward finished its reduction."""
        if self.phase in (Phase.REDUCING, Phase.RECORDING):
            raise reducer_errors.not_finalized()

    # ------------------------------------------------------------- iteration
    def prepare_for_backward(self, outputs: Any, sync: bool) -> None:
        """Called after each grad-enabled DDP forward: expect hooks for this graph."""
        if not sync:
            self.phase = Phase.LOCAL_ARMED
            return
        self.phase = Phase.ARMED
        self._next_launch = 0
        self._fires_left = bytearray(self.counts.expected)
        for bucket in self.buckets:
            bucket.reset()
        self.unused.search(outputs)
        if not self.counts.recording:
            self._plan_skipped_buckets()
        self._end.watch(outputs)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        """The hot path: one call per parameter per backward."""
        if self.phase is not _REDUCING and not self._enter_reduction(i, param):
            return
        self._used[i] = 1
        if self._fires_left[i] != 1:
            self._count_down_or_refuse(i)
            return
        self._fires_left[i] = 0
        if self._recording_arrival:
            self._arrival.append(i)
        bucket = self._bucket_of[i]
        if bucket.mark_ready(self._slot_of[i], param) and bucket.index == self._next_launch:
            self._launch_ready_buckets()

    def _count_down_or_refuse(self, i: int) -> None:
        """A gradient before a parameter's last expected one (static_graph), or one too many."""
        left = self._fires_left[i]
        if left == 0:
            self._raise_ready_twice(i)
        self._fires_left[i] = left - 1

    def _enter_reduction(self, i: int, param: torch.Tensor) -> bool:
        """A gradient outside REDUCING: start a backward, count, accumulate, ignore, or refuse.

        True when the gradient should go on through the reducing path.
        """
        phase = self.phase
        if phase is Phase.ARMED:
            self._begin_backward()
            if self.timeline is not None:
                self.timeline.backward_started()
            self._end.queue()  # no-op when an output's hook queued it (the usual case)
            if not self.counts.recording:
                self.phase = Phase.REDUCING
                self._mark_unused_ready()
                return True
            self.phase = phase = Phase.RECORDING
        elif phase is Phase.LOCAL_ARMED:
            self._begin_backward()
            self.phase = phase = Phase.LOCAL
        elif phase is Phase.REDUCED:
            self._raise_ready_twice(i)
        if phase is Phase.RECORDING or phase is Phase.LOCAL:
            self._used[i] = 1
            if self._recording_arrival:
                self._arrival.append(i)
            if phase is Phase.RECORDING:
                self.counts.count(i)
            elif self.gradient_as_bucket_view:
                self._bucket_of[i].accumulate_in_view(self._slot_of[i], param)
        return False

    def _begin_backward(self) -> None:
        self._backwards_seen += 1
        self._recording_arrival = self._backwards_seen == 1 and not self._rebuilt

    def _mark_unused_ready(self) -> None:
        """A parameter the graph does not reach still fills its slot, or its bucket never goes."""
        for i in self.unused.now:
            if self._fires_left[i] == 0:
                self._raise_ready_twice(i)
            self._fires_left[i] = 0
            param = self.params[i]
            if self.gradient_as_bucket_view and param.grad is not None:
                self.unused.save_local(i, param.grad)
            self._fill_slot(i, param)

    def _fill_slot(self, i: int, param: torch.Tensor) -> None:
        bucket = self._bucket_of[i]
        if bucket.mark_ready(self._slot_of[i], param) and bucket.index == self._next_launch:
            self._launch_ready_buckets()

    def _plan_skipped_buckets(self) -> None:
        """skip_all_reduce_unused_params: agree on the buckets that no rank uses this time.

        torch skips the buckets unused on *this* rank and hangs if another rank
        used them; agreeing first (one small all-reduce after forward) skips
        only what is unused everywhere, so a rank that differs costs bandwidth,
        not a deadlock. Under static_graph the set never changes: agreed once
        per bucket layout.
        """
        if not self.skip_unused_buckets or not self.unused.tracked:
            return
        if self.unused.static_graph and self._skip_planned_for is self.buckets:
            return
        unused = set(self.unused.now)
        mine = [all(i in unused for i in b.param_indices) for b in self.buckets]
        everywhere = self.signals.agree(mine)
        self.stats.collectives += 1
        self._skipped = frozenset(k for k, skip in enumerate(everywhere) if skip)
        self._skip_planned_for = self.buckets

    def _launch_ready_buckets(self) -> None:
        """Launch every consecutive full bucket from `_next_launch`: same order on all ranks."""
        buckets, k = self.buckets, self._next_launch
        while k < len(buckets) and buckets[k].pending == 0:
            if k in self._skipped:
                self.stats.buckets_skipped += 1
            else:
                buckets[k].launch(self.reduction)
                progress.collective("ddp all_reduce bucket", k, self.stats.sync_rounds + 1)
                if self.timeline is not None:
                    self._record_flight(buckets[k])
                self.stats.buckets_launched += 1
                self.stats.collectives += 1
            k += 1
        self._next_launch = k

    # --------------------------------------------------------------- finalize
    def _end_of_backward(self) -> None:
        """The autograd engine's callback when the outermost backward ends."""
        if self.phase is Phase.RECORDING:
            self._finish_recording()
        if self.phase is Phase.REDUCING:
            self._finalize()

    def _finish_recording(self) -> None:
        """static_graph's first backward ended: fix the counts, then send every bucket."""
        self.unused.set_static(self.counts.finish())
        self._fires_left = bytearray(self.counts.expected)
        self.phase = Phase.REDUCING
        self._plan_skipped_buckets()
        self._mark_unused_ready()
        for i, param in enumerate(self.params):
            if self._fires_left[i]:
                self._fires_left[i] = 0
                self._fill_slot(i, param)

    def _flag_carrier(self) -> torch.Tensor | None:
        """The last bucket's flag slots, when the flags ride in its collective."""
        last = len(self.buckets) - 1
        if self.reduction.carries_flags and last not in self._skipped:
            return self.buckets[last].flags
        return None

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, learn what the other ranks saw, write back."""
        with torch.profiler.record_function("phalanx.ddp.finalize"):
            self.phase = Phase.REDUCED
            start = time.perf_counter_ns()
            if self._next_launch < len(self.buckets):
                self._launch_despite_missing_gradients()
            for bucket in self.buckets:
                bucket.wait(self.reduction)
            outcome = self.signals.exchange(
                self._flag_carrier(), self._used if self.unused.tracked else None
            )
            end = time.perf_counter_ns()
            self.stats.comm_wait_s += (end - start) / 1e9
            if self.timeline is not None:
                self.timeline.backward_waited(start, end)
            self.stats.collectives += outcome.collectives
            if outcome.failed_ranks:
                self._raise_for_failed_ranks(outcome.failed_ranks)
            unused_everywhere = self.unused.unused_everywhere(outcome.used_counts)
            self.unused.restore_saved(self._slot_view, unused_everywhere)
            for bucket in self.buckets:
                if bucket.index not in self._skipped:
                    self.reduction.write_back(bucket, unused_everywhere)
            self.stats.sync_rounds += 1
            self.unused.end_iteration()

    def _record_flight(self, bucket: Bucket) -> None:
        """Timeline: this bucket's flight, completed by its collective's own future."""
        work = bucket.work
        future = work.get_future() if hasattr(work, "get_future") else work
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        assert self.timeline is not None
        self.timeline.bucket_launched(bucket.index, nbytes, future)

    def _launch_despite_missing_gradients(self) -> None:
        """Some gradients never came: still send every bucket, with this rank's flag raised.

        The other ranks are waiting in those collectives; sending them keeps every
        rank in step, and the flag tells all of them to stop with an error.
        """
        for i, left in enumerate(self._fires_left):
            if left:
                self._bucket_of[i].mark_missing(self._slot_of[i])
        self.signals.raise_flag(self._flag_carrier())
        self._launch_ready_buckets()

    # ----------------------------------------------------------------- errors
    def _raise_ready_twice(self, i: int) -> None:
        raise reducer_errors.ready_twice(self.names[i], self.unused.static_graph)

    def _raise_for_failed_ranks(self, failed: list[int]) -> None:
        missing = [self.names[i] for i, left in enumerate(self._fires_left) if left]
        if missing:
            raise reducer_errors.missing_gradients(missing, failed)
        raise reducer_errors.missing_elsewhere(failed)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
