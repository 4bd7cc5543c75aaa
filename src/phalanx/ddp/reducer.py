"""The gradient reducer: routes each gradient to its bucket and drives one iteration.

Life of one synced iteration (docs/architecture.md draws it):
  forward  -> `prepare_for_backward` arms the reducer; with unused-parameter
              tracking, `UnusedParameters` lists what the graph misses;
  backward -> each parameter's hook marks it ready in its `Bucket`; a full
              bucket is launched through the `BucketReduction`, strictly in
              bucket order so every rank issues the same collectives;
  end      -> `_finalize` (run by the autograd engine when backward ends)
              waits for every bucket, exchanges the `StepSignals` (failure
              flags, used map) and writes the reduced gradients to `.grad`.
The hook runs once per parameter per step in Python, so it is kept minimal.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from phalanx.ddp.autograd import at_end_of_backward
from phalanx.ddp.buckets import FIRST_BUCKET_BYTES, Bucket, assign_buckets
from phalanx.ddp.reductions import AllReduce, BucketReduction
from phalanx.ddp.signals import StepSignals
from phalanx.ddp.unused import UnusedParameters
from phalanx.diagnostics import progress
from phalanx.errors import ReducerError


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
    REDUCED = "reduced"
    """Reduced: another gradient before the next forward is an error."""


# The hook compares against this module constant: no attribute lookup on Phase per call.
_REDUCING = Phase.REDUCING


@dataclass
class ReducerStats:
    """Counters a user (or a test) can read to see what the reducer really did."""

    sync_rounds: int = 0  # backward passes whose gradients were reduced
    buckets_launched: int = 0  # bucket collectives launched
    collectives: int = 0  # every collective launched for gradients (buckets + step signals)
    comm_wait_s: float = 0.0  # time spent waiting on communication at the end of backward
    rebuilds: int = 0  # bucket rebuilds (at most one)


class Reducer:
    """Averages the gradients of `named_params` across `group` during backward."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup,
        bucket_cap_bytes: int,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_cap_bytes = bucket_cap_bytes
        # A cap below the usual small first bucket is a cap on every bucket.
        self._first_cap = min(FIRST_BUCKET_BYTES, bucket_cap_bytes)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.stats = ReducerStats()
        self.reduction: BucketReduction = AllReduce(group)
        self.unused = UnusedParameters(self.params, find_unused_parameters, static_graph)
        self.signals = StepSignals(group, self.params[0].device)
        self.phase = Phase.IDLE
        self._used = self.unused.used  # the same bytearray, reset in place
        self._ready = bytearray(len(self.params))
        self._next_launch = 0
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
        assignment = assign_buckets(self.params, order, self.bucket_cap_bytes, self._first_cap)
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
            )
            for k, indices in enumerate(assignment)
        ]
        self._bucket_of: list[Bucket] = [self.buckets[0]] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._bucket_of[i], self._slot_of[i] = bucket, slot
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
        n = len(self.params)
        order = torch.full((n,), -1, dtype=torch.int64)
        arrival = self._arrival[:n]
        if arrival:
            order[: len(arrival)] = torch.tensor(arrival, dtype=torch.int64)
        order = order.to(self.signals.device)
        dist.broadcast(order, src=dist.get_global_rank(self.group, 0), group=self.group)
        seen = [i for i in order.tolist() if i >= 0]
        seen_set = set(seen)
        new_order = seen + [i for i in reversed(range(n)) if i not in seen_set]
        self._arrival = []
        self.stats.rebuilds += 1
        new = assign_buckets(self.params, new_order, self.bucket_cap_bytes, self._first_cap)
        if new != [b.param_indices for b in self.buckets]:
            self._build(new_order)

    # ------------------------------------------------------------- iteration
    def prepare_for_backward(self, outputs: Any, sync: bool) -> None:
        """Called after each grad-enabled DDP forward: expect hooks for this graph."""
        if not sync:
            self.phase = Phase.LOCAL_ARMED
            return
        self.phase = Phase.ARMED
        self._next_launch = 0
        self._ready = bytearray(len(self.params))
        for bucket in self.buckets:
            bucket.reset()
        self.unused.search(outputs)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        """The hot path: one call per parameter per backward."""
        if self.phase is not _REDUCING and not self._enter_reduction(i, param):
            return
        self._used[i] = 1
        if self._recording_arrival:
            self._arrival.append(i)
        if self._ready[i]:
            self._raise_ready_twice(i)
        self._ready[i] = 1
        bucket = self._bucket_of[i]
        if bucket.mark_ready(self._slot_of[i], param) and bucket.index == self._next_launch:
            self._launch_ready_buckets()

    def _enter_reduction(self, i: int, param: torch.Tensor) -> bool:
        """A gradient outside REDUCING: start a backward, accumulate, ignore, or refuse.

        True when the gradient should go on through the reducing path.
        """
        phase = self.phase
        if phase is Phase.ARMED:
            self._begin_backward()
            self.phase = Phase.REDUCING
            at_end_of_backward(self._finalize)
            self._mark_unused_ready()
            return True
        if phase is Phase.LOCAL_ARMED:
            self._begin_backward()
            self.phase = phase = Phase.LOCAL
        if phase is Phase.LOCAL:
            self._used[i] = 1
            if self._recording_arrival:
                self._arrival.append(i)
            if self.gradient_as_bucket_view:
                self._bucket_of[i].accumulate_in_view(self._slot_of[i], param)
        elif phase is Phase.REDUCED:
            self._raise_ready_twice(i)
        return False

    def _begin_backward(self) -> None:
        self._backwards_seen += 1
        self._recording_arrival = self._backwards_seen == 1 and not self._rebuilt

    def _mark_unused_ready(self) -> None:
        """A parameter the graph does not reach still fills its slot, or its bucket never goes."""
        for i in self.unused.now:
            if self._ready[i]:
                self._raise_ready_twice(i)
            self._ready[i] = 1
            param = self.params[i]
            if self.gradient_as_bucket_view and param.grad is not None:
                self.unused.save_local(i, param.grad)
            bucket = self._bucket_of[i]
            if bucket.mark_ready(self._slot_of[i], param) and bucket.index == self._next_launch:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every consecutive full bucket from `_next_launch`: same order on all ranks."""
        buckets, k = self.buckets, self._next_launch
        while k < len(buckets) and buckets[k].pending == 0:
            buckets[k].launch(self.reduction)
            progress.collective("ddp all_reduce bucket", k, self.stats.sync_rounds + 1)
            self.stats.buckets_launched += 1
            self.stats.collectives += 1
            k += 1
        self._next_launch = k

    # --------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """End of backward: wait for every bucket, learn what the other ranks saw, write back."""
        with torch.profiler.record_function("phalanx.ddp.finalize"):
            self.phase = Phase.REDUCED
            start = time.perf_counter()
            if self._next_launch < len(self.buckets):
                self._launch_despite_missing_gradients()
            for bucket in self.buckets:
                bucket.wait(self.reduction)
            outcome = self.signals.exchange(
                self.buckets[-1].flags if self.reduction.carries_flags else None,
                self._used if self.unused.tracked else None,
            )
            self.stats.comm_wait_s += time.perf_counter() - start
            self.stats.collectives += outcome.collectives
            if outcome.failed_ranks:
                self._raise_for_failed_ranks(outcome.failed_ranks)
            unused_everywhere = self.unused.unused_everywhere(outcome.used_counts)
            self.unused.restore_saved(self._slot_view, unused_everywhere)
            for bucket in self.buckets:
                self.reduction.write_back(bucket, unused_everywhere)
            self.stats.sync_rounds += 1
            self.unused.end_iteration()

    def _launch_despite_missing_gradients(self) -> None:
        """Some gradients never came: still send every bucket, with this rank's flag raised.

        The other ranks are waiting in those collectives; sending them keeps every
        rank in step, and the flag tells all of them to stop with an error.
        """
        for i, ready in enumerate(self._ready):
            if not ready:
                self._bucket_of[i].mark_missing(self._slot_of[i])
        self.signals.raise_flag(self.buckets[-1].flags if self.reduction.carries_flags else None)
        self._launch_ready_buckets()

    # ----------------------------------------------------------------- errors
    def _raise_ready_twice(self, i: int) -> None:
        raise ReducerError(
            f"parameter '{self.names[i]}' was marked ready twice in one iteration: its gradient "
            "arrived after it had already been reduced (a second backward through the same "
            "forward, a parameter used outside forward(), or reentrant checkpointing) — run "
            "one forward per backward through the DDP model, or accumulate with no_sync()"
        )

    def _raise_for_failed_ranks(self, failed: list[int]) -> None:
        if not all(self._ready):
            self._raise_missing_gradients(failed)
        raise ReducerError(
            f"rank(s) {failed} received no gradient for some parameters in this backward (their "
            "own error names them) — pass find_unused_parameters=True to "
            "DistributedDataParallel if some parameters are legitimately unused on some ranks"
        )

    def _raise_missing_gradients(self, failed: list[int]) -> None:
        missing = [self.names[i] for i, ready in enumerate(self._ready) if not ready]
        shown = ", ".join(missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        raise ReducerError(
            f"{len(missing)} parameter(s) received no gradient in this backward (ranks with "
            f"missing gradients: {failed}): {shown} — pass find_unused_parameters=True to "
            "DistributedDataParallel if some parameters are legitimately unused, or make sure "
            "every parameter contributes to the loss"
        )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
