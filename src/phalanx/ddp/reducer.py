"""The gradient reducer: routes each gradient to its bucket and drives one iteration.

Life of one synced iteration (docs/architecture.md draws it):
  forward  -> `prepare_for_backward` arms the reducer; with unused-parameter
              tracking, `UnusedParameters` lists what the graph misses;
  backward -> each parameter's hook marks it ready in its `Bucket`; a full
              bucket is launched through the `BucketReduction`, strictly in
              bucket order so every rank issues the same collectives (the
              `BucketSet`, phalanx.ddp.bucket_set, holds buckets and order);
  end      -> `_finalize` (run by the autograd engine when the outermost
              backward through this forward ends, phalanx.parallel.autograd)
              waits for every bucket, exchanges the `StepSignals` (failure
              flags, used map) and writes the reduced gradients to `.grad`
              (bucket by bucket as each is done, when there is no used map).
With static_graph, the first synced backward only counts gradients per
parameter (phase RECORDING, phalanx.ddp.static_graph) and sends every bucket
at its end. The hook runs once per parameter per step in Python, so it is
kept minimal. Under Join, a rank out of batches runs `shadow_iteration`
instead: the same collectives, with no gradient of its own (phalanx.ddp.join).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.ddp import reducer_errors
from phalanx.ddp.bucket_set import BucketSet
from phalanx.ddp.buckets import Bucket
from phalanx.ddp.layout import BucketPlan
from phalanx.ddp.phase import Phase
from phalanx.ddp.reductions import AllReduce, BucketReduction
from phalanx.ddp.signals import StepSignals
from phalanx.ddp.static_graph import GradientCounts
from phalanx.ddp.unused import BucketSkips, UnusedParameters
from phalanx.parallel.autograd import EndOfBackward, profiled
from phalanx.parallel.traffic import ReducerStats, TimedWait

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from phalanx.diagnostics.timeline import Timeline

__all__ = ["Phase", "Reducer", "ReducerStats"]


# The hook compares against this module constant: no attribute lookup on Phase per call.
_REDUCING = Phase.REDUCING


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
        tune_bucket_size: bool = False,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.timeline: Timeline | None = None
        """Where backward, bucket flights and the final wait are recorded (None: nowhere)."""
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.stats = ReducerStats()
        views, deferred = gradient_as_bucket_view, batched_copy
        self.bucket_set = BucketSet(
            self.params, self.world_size, AllReduce(group), grads_in_views=views, deferred=deferred
        )
        """The buckets, which bucket and slot each gradient goes to, and their reduction."""
        self.sharded_by: Callable[[], object | None] = lambda: None
        """A weak reference to the ZeroRedundancyOptimizer whose pieces these parameters are
        (set by it): its step is a collective of its own, which Join must know about."""
        self.unused = UnusedParameters(self.params, find_unused_parameters, static_graph)
        self.counts = GradientCounts(self.names, static_graph)
        self.signals = StepSignals(group, self.params[0].device, self.stats)
        device, tune = self.signals.device, tune_bucket_size
        self.plan = BucketPlan(self.params, bucket_caps, group, device, self.stats, tune=tune)
        """The order and the caps the buckets are built from (phalanx.ddp.layout)."""
        self.phase = Phase.IDLE
        self._end = EndOfBackward(self._end_of_backward)
        self._used = self.unused.used  # the same bytearray, reset in place
        # Per parameter, gradients still to come before it is ready (0: ready). 1 each,
        # except under static_graph for a parameter used by several reentrant checkpoints.
        self._fires_left = bytearray(self.counts.expected)
        self.skips = BucketSkips(skip_unused_buckets, self.unused, self.signals)
        """skip_all_reduce_unused_params: a bucket unused on every rank is not sent."""
        self._backwards_seen = 0
        self._recording_arrival = False
        self._arrival = self.plan.arrival  # first backward's gradient order, for the rebuild
        self._backward_started = 0.0  # perf_counter() at the first gradient of this backward
        self._build()
        self._handles = self._hook_parameters()

    def _hook_parameters(self) -> list[RemovableHandle]:
        """Call `_on_grad_ready` when each parameter's gradient is accumulated.

        A partial of the bound method: C-level on the hot path, and the hook is
        how ddp/registry.py finds this reducer from a parameter.
        """
        return [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------- buckets
    def _build(self) -> None:
        """(Re)allocate the buckets as the plan says, keeping any gradients already there."""
        self.bucket_set.build(self.plan.layout())
        # The hook path reads these two lists: no attribute lookup through the set per call.
        self._bucket_of, self._slot_of = self.bucket_set.bucket_of, self.bucket_set.slot_of
        self.skips.skipped = frozenset()

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order."""
        return self.bucket_set.buckets

    @property
    def reduction(self) -> BucketReduction[Any]:
        """What a full bucket does (phalanx.ddp.reductions)."""
        return self.bucket_set.reduction

    def set_reduction(self, reduction: BucketReduction[Any]) -> None:
        """Choose what a full bucket does; it keeps the divisor (Join's) the last one had."""
        if self.bucket_set.set_reduction(reduction):
            self._build()

    def average_over(self, ranks: int) -> None:
        """Divide the summed gradients by `ranks` from now on (Join with
        divide_by_initial_world_size=False: the ranks still training), whichever reduction
        runs (BucketReduction.set_divisor; a hook gets it in its HookState)."""
        self.reduction.set_divisor(ranks)

    def bucket_order(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for logs and tests)."""
        return [[self.names[i] for i in b.param_indices] for b in self.buckets]

    def rebuild_due(self) -> bool:
        """Whether the next synced forward rebuilds the buckets in arrival order (once)."""
        return self.plan.rebuild_due(self._backwards_seen)

    def before_sync_forward(self, rebuild: bool | None = None) -> None:
        """Before a grad-enabled synced forward: the arrival-order rebuild when due, then
        bucket_cap_mb="auto"'s next step. A rank shadowing under Join passes `rebuild`
        as the training ranks decided it (its own backwards may not have happened)."""
        rebuild = self.rebuild_due() if rebuild is None else rebuild
        if rebuild:
            self._recording_arrival = False
        if self.plan.before_sync_forward(rebuild):
            self._build()

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
        self._start_iteration()
        self.unused.search(outputs)
        if not self.counts.recording:
            self._plan_skipped_buckets()
        self._end.watch(outputs)

    def _start_iteration(self) -> None:
        self.phase = Phase.ARMED
        self._fires_left = bytearray(self.counts.expected)
        self.bucket_set.start_iteration()

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
        if bucket.mark_ready(self._slot_of[i], param):  # full: launched if it is next
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
            self._begin_backward(synced=True)
            self._end.queue()  # no-op when an output's hook queued it (the usual case)
            if not self.counts.recording:
                self.phase = Phase.REDUCING
                self._mark_ready_unused(self.unused.now)
                return True
            self.phase = phase = Phase.RECORDING
        elif phase is Phase.LOCAL_ARMED:
            self._begin_backward(synced=False)
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

    def _begin_backward(self, synced: bool) -> None:
        self._backwards_seen += 1
        self._recording_arrival = self._backwards_seen == 1 and not self.plan.rebuilt
        if synced:
            self._synced_backward_started()

    def _synced_backward_started(self) -> None:
        self._backward_started = time.perf_counter()
        if self.timeline is not None:
            self.timeline.backward_started()

    def _mark_ready_unused(self, indices: Iterable[int]) -> None:
        """A parameter the graph does not reach still fills its slot, or its bucket never goes."""
        for i in indices:
            if self._fires_left[i] == 0:
                self._raise_ready_twice(i)
            self._fires_left[i] = 0
            param = self.params[i]
            if self.gradient_as_bucket_view and param.grad is not None:
                self.unused.save_local(i, param.grad)
            self._fill_slot(i, param)

    def _fill_slot(self, i: int, param: torch.Tensor) -> None:
        bucket = self._bucket_of[i]
        if bucket.mark_ready(self._slot_of[i], param):  # full: launched if it is next
            self._launch_ready_buckets()

    def _plan_skipped_buckets(self) -> None:
        if self.skips.due(self.buckets):
            self.skips.agree(self.buckets, set(self.unused.now))

    def _launch_ready_buckets(self) -> None:
        self.bucket_set.launch_ready(self.skips.skipped, self.stats, self.timeline)

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
        self._mark_ready_unused(self.unused.now)
        for i, param in enumerate(self.params):
            if self._fires_left[i]:
                self._fires_left[i] = 0
                self._fill_slot(i, param)

    def _finalize(self, shadow: bool = False, send_local: bool = True) -> None:
        """End of backward: wait for every bucket, learn what the other ranks saw, write back.

        `shadow`: this rank had no batch (`shadow_iteration`); then every parameter
        counts as unused here, and `send_local=False` leaves `.grad` alone.
        """
        with profiled("phalanx.ddp.finalize"):
            self.phase = Phase.REDUCED
            with TimedWait() as waited:
                if self.bucket_set.next_launch < len(self.buckets):
                    self._launch_despite_missing_gradients()
                # Without a used map to learn first, a bucket's gradients go to `.grad` as
                # soon as it is reduced, while later buckets are still in flight (torch's order).
                early = send_local and not self.unused.tracked
                self.bucket_set.wait_all(self.stats, self.skips.skipped if early else None)
                flags = self.bucket_set.flag_carrier(self.skips.skipped)
                used = self._used if self.unused.tracked else None
                outcome = self.signals.exchange(flags, used)
            self._waited(waited, shadow)
            if outcome.failed_ranks:
                self._raise_for_failed_ranks(outcome.failed_ranks)
            if outcome.used_counts is not None:
                self.unused.remember(outcome.used_counts, shadowed=shadow)
            here = range(len(self.params)) if shadow else self.unused.now
            unused_everywhere = self.unused.unused_everywhere(outcome.used_counts, here)
            if send_local and not early:
                self.unused.restore_saved(self.bucket_set.slot_view, unused_everywhere)
                self.bucket_set.write_back(self.skips.skipped, unused_everywhere)
            self.unused.end_iteration()

    def _waited(self, waited: TimedWait, shadow: bool) -> None:
        """Book the end-of-backward wait: counters, timeline, the bucket-size tuner."""
        self.stats.add(waited.traffic())
        if self.timeline is not None:
            self.timeline.backward_waited(waited.start_ns, waited.end_ns)
        if shadow:
            self.stats.shadow_rounds += 1
            return
        self.stats.sync_rounds += 1
        tuner = self.plan.tuner
        if tuner is not None and not tuner.done:
            tuner.record(waited.end_ns / 1e9 - self._backward_started)

    def _launch_despite_missing_gradients(self) -> None:
        """Some gradients never came: still send every bucket, with this rank's flag raised.

        The other ranks are waiting in those collectives; sending them keeps every
        rank in step, and the flag tells all of them to stop with an error.
        """
        for i, left in enumerate(self._fires_left):
            if left:
                self._bucket_of[i].mark_missing(self._slot_of[i])
        self.signals.raise_flag(self.bucket_set.flag_carrier(self.skips.skipped))
        self._launch_ready_buckets()

    # ------------------------------------------------------------------ Join
    def shadow_iteration(self, send_local: bool = False) -> None:
        """A rank out of batches takes part in the others' synced iteration (phalanx.ddp.join).

        As if its forward had used no parameter: the bucket agreement, every
        bucket in order and the step signals go as on the training ranks, so a
        training rank's failure raises here too. The buckets hold zeros, or with
        `send_local` this rank's own `.grad` (what it accumulated under no_sync
        before its batches ran out, kept in the average), and then `.grad` gets
        the averages as on the training ranks. Without it `.grad` is left alone
        (torch's join; with gradient_as_bucket_view it holds the average).
        """
        self._start_iteration()
        self._synced_backward_started()
        if not send_local:
            self._used[:] = self.unused.last_used  # torch's stale map (UnusedParameters.remember)
        everything = range(len(self.params))
        if self.skips.due(self.buckets):
            self.skips.agree(self.buckets, set(everything))
        self.phase = Phase.REDUCING
        if send_local:
            self._mark_ready_unused(everything)
        else:
            for i in everything:
                self._fires_left[i] = 0
                self._bucket_of[i].mark_missing(self._slot_of[i])
            self._launch_ready_buckets()
        self._finalize(shadow=True, send_local=send_local)

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
