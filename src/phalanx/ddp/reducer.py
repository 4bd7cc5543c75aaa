"""The gradient reducer: per-parameter hooks, in-order async all-reduce, finalize.

Life of one synced iteration:
  forward  -> `prepare_for_backward` arms the reducer (and, with
              find_unused_parameters, lists the parameters the graph misses);
  backward -> each parameter's hook copies its gradient into its bucket; a
              bucket whose last gradient arrived is all-reduced asynchronously,
              strictly in bucket order so every rank issues the same sequence;
  end      -> `_finalize` (an autograd-engine callback) waits, and hands the
              averaged gradients back to `.grad`.
The hook runs once per parameter per step in Python, so it is kept minimal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from phalanx.ddp.buckets import FIRST_BUCKET_BYTES, Bucket, assign_buckets, make_bucket
from phalanx.ddp.comm_hooks import CommHook, GradBucket
from phalanx.ddp.graph import reachable_leaves
from phalanx.errors import ReducerError

# Where the reducer is in the current iteration.
IDLE = 0  # no DDP forward since the last reduction: hooks are ignored
ARMED = 1  # a DDP forward ran: hooks are expected
REDUCED = 2  # this iteration's gradients are reduced: another hook is an error


@dataclass
class ReducerStats:
    """Counters a user (or a test) can read to see what the reducer really did."""

    sync_rounds: int = 0  # backward passes whose gradients were all-reduced
    buckets_launched: int = 0  # gradient all-reduces launched
    collectives: int = 0  # every collective launched from backward (buckets + used-maps)
    comm_wait_s: float = 0.0  # time spent waiting on communication at end of backward
    rebuilds: int = 0  # bucket rebuilds (at most one)


class Reducer:
    """Averages the gradients of `params` across `group` during backward."""

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
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.stats = ReducerStats()
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None

        n = len(self.params)
        # A 0-dim tensor, not a float: torch.mul with a Python scalar costs twice as much
        # per call, and this runs once per parameter per step.
        self._inv_world = torch.tensor(1.0 / self.world_size)
        self._state = IDLE
        self._sync = True
        self._backward_started = False
        self._ready = bytearray(n)
        self._used = bytearray(n)  # got a gradient since the last reduction
        self._next_launch = 0
        self._unused_now: list[int] = []  # graph search result for this iteration
        self._static_unused: list[int] | None = None
        self._saved_unused_grads: dict[int, torch.Tensor] = {}
        self._flags_work: Any = None  # the flag slots' all-reduce when a comm hook runs
        self._arrival: list[int] = []  # first backward's gradient order, for the rebuild
        self._backwards_seen = 0
        self._rebuilt = False
        self._leaf_index = {id(p): i for i, p in enumerate(self.params)}
        self._build(list(reversed(range(n))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------- buckets
    def _build(self, order: list[int]) -> None:
        """(Re)allocate the buckets for arrival `order`, keeping any gradients already there."""
        assignment = assign_buckets(self.params, order, self.bucket_cap_bytes, self._first_cap)
        last = len(assignment) - 1
        self.buckets: list[Bucket] = [
            make_bucket(k, idx, self.params, self.world_size if k == last else 0)
            for k, idx in enumerate(assignment)
        ]
        self._bucket_of: list[Bucket] = [self.buckets[0]] * len(self.params)
        self._view_of: list[torch.Tensor] = [self.buckets[0].buffer] * len(self.params)
        for bucket in self.buckets:
            for i, view in zip(bucket.param_indices, bucket.views):
                self._bucket_of[i] = bucket
                self._view_of[i] = view
        if self.gradient_as_bucket_view:
            self._bind_grads_to_views()

    def _bind_grads_to_views(self) -> None:
        with torch.no_grad():
            for p, view in zip(self.params, self._view_of):
                if p.grad is not None and p.grad is not view:
                    view.copy_(p.grad)
                    p.grad = view

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
        n = len(self.params)
        order = torch.full((n,), -1, dtype=torch.int64)
        arrival = self._arrival[:n]
        if arrival:
            order[: len(arrival)] = torch.tensor(arrival, dtype=torch.int64)
        dist.broadcast(order, src=dist.get_global_rank(self.group, 0), group=self.group)
        seen = [i for i in order.tolist() if i >= 0]
        seen_set = set(seen)
        rest = [i for i in reversed(range(n)) if i not in seen_set]
        new_order = seen + rest
        self._arrival = []
        self.stats.rebuilds += 1
        if assign_buckets(self.params, new_order, self.bucket_cap_bytes, self._first_cap) == [
            b.param_indices for b in self.buckets
        ]:
            return
        self._build(new_order)

    # ------------------------------------------------------------- iteration
    def prepare_for_backward(self, outputs: Any, sync: bool) -> None:
        """Called after each grad-enabled DDP forward: expect hooks for this graph."""
        self._state = ARMED
        self._sync = sync
        self._backward_started = False
        if not sync:
            return
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()
        if self.static_graph and self._static_unused is not None:
            self._unused_now = self._static_unused
        elif self.find_unused_parameters or self.static_graph:
            reached = reachable_leaves(outputs)
            index = self._leaf_index
            self._unused_now = [i for p, i in index.items() if p not in reached]
            self._unused_now.sort()
            if self.static_graph:
                self._static_unused = self._unused_now

    def _make_hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(i, param)

        return hook

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        state = self._state
        if state != ARMED:
            if state == REDUCED:
                self._raise_ready_twice(i)
            return
        self._used[i] = 1
        if not self._backward_started:
            self._start_backward()
        if self._backwards_seen == 1 and not self._rebuilt:
            self._arrival.append(i)
        view = self._view_of[i]
        if not self._sync:
            if self.gradient_as_bucket_view and param.grad is not view:
                self._move_grad_into_view(param, view)
            return
        if self._ready[i]:
            self._raise_ready_twice(i)
        self._ready[i] = 1
        if self.gradient_as_bucket_view:
            if param.grad is not view:
                self._move_grad_into_view(param, view)
        else:
            self._copy_into_slot(param.grad, view)  # type: ignore[arg-type]  # set: hook follows it
        bucket = self._bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next_launch:
            self._launch_ready_buckets()

    def _copy_into_slot(self, grad: torch.Tensor, view: torch.Tensor) -> None:
        if self.comm_hook is None:
            # Average while copying, as torch DDP does: no second pass over the bucket.
            torch.mul(grad, self._inv_world, out=view)
        else:
            view.copy_(grad)  # a comm hook averages in its own way

    @staticmethod
    def _move_grad_into_view(param: torch.Tensor, view: torch.Tensor) -> None:
        with torch.no_grad():
            view.copy_(param.grad)  # type: ignore[arg-type]
        param.grad = view

    def _start_backward(self) -> None:
        self._backward_started = True
        self._backwards_seen += 1
        if not self._sync:
            return
        Variable._execution_engine.queue_callback(self._finalize)
        for i in self._unused_now:
            self._mark_unused_ready(i)

    def _mark_unused_ready(self, i: int) -> None:
        """A parameter the graph does not reach still fills its slot, or its bucket never goes."""
        if self._ready[i]:
            self._raise_ready_twice(i)
        self._ready[i] = 1
        param, view = self.params[i], self._view_of[i]
        grad = param.grad
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self.gradient_as_bucket_view:
                # .grad is the bucket slot itself, and the all-reduce will overwrite it:
                # keep the local value in case no rank used this parameter.
                self._saved_unused_grads[i] = grad.clone()
                if grad is not view:
                    self._move_grad_into_view(param, view)
            else:
                self._copy_into_slot(grad, view)
        bucket = self._bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next_launch:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every consecutive ready bucket from `_next_launch`: same order on all ranks."""
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.comm_hook is not None:
            grad_bucket = GradBucket(
                bucket.index,
                bucket.grads,
                bucket.params,
                bucket.views,
                bucket.index == len(self.buckets) - 1,
            )
            bucket.work = self.comm_hook(self.comm_state, grad_bucket)
            if bucket is self.buckets[-1]:
                # A hook's wire format is its own, so the flag slots travel on their own.
                self._flags_work = dist.all_reduce(bucket.flags, group=self.group, async_op=True)
                self.stats.collectives += 1
        else:
            if self.gradient_as_bucket_view:
                # The gradients were accumulated in place, not copied: average them here.
                bucket.buffer.mul_(self._inv_world)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self.stats.buckets_launched += 1
        self.stats.collectives += 1

    # --------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """End of backward: wait for every bucket and hand the averages to `.grad`."""
        with torch.profiler.record_function("phalanx.ddp.finalize"):
            self._state = REDUCED
            start = time.perf_counter()
            if self._next_launch < len(self.buckets):
                self._launch_despite_missing_gradients()
            # Every rank takes part in the used-map reduction whenever unused parameters are
            # tracked at all, even with none unused locally: a collective skipped by one
            # rank would pair the next ones wrongly.
            track = self.find_unused_parameters or self.static_graph
            globally_unused = self._reduce_used_map() if track else []
            self._wait(self.buckets)
            self.stats.comm_wait_s += time.perf_counter() - start
            self._raise_if_any_rank_failed()
            self._write_back(globally_unused)
            self.stats.sync_rounds += 1
            self._ready = bytearray(len(self.params))
            self._used = bytearray(len(self.params))
            self._saved_unused_grads.clear()

    def _wait(self, buckets: Sequence[Bucket]) -> None:
        for bucket in buckets:
            work = bucket.work
            if work is None:
                continue
            if self.comm_hook is not None:
                work.wait()  # type: ignore[attr-defined]
                result = work.value()  # type: ignore[attr-defined]
                if isinstance(result, list):
                    result = result[0]
                if result is not bucket.grads:
                    bucket.grads.copy_(result)
            else:
                work.wait()  # type: ignore[attr-defined]
            bucket.work = None

    def _reduce_used_map(self) -> list[int]:
        """Which of this rank's unused parameters went unused on every rank."""
        used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8).to(torch.int32)
        dist.all_reduce(used, group=self.group)
        self.stats.collectives += 1
        counts = used.tolist()
        return [i for i in self._unused_now if counts[i] == 0]

    def _write_back(self, globally_unused: list[int]) -> None:
        skip = set(globally_unused)
        with torch.no_grad():
            for i, saved in self._saved_unused_grads.items():
                if i in skip:
                    self._view_of[i].copy_(saved)
            if self.gradient_as_bucket_view:
                for i in self._unused_now:
                    if i not in skip and self.params[i].grad is None:
                        self.params[i].grad = self._view_of[i]
                return
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            for i, (p, view) in enumerate(zip(self.params, self._view_of)):
                if i in skip:
                    continue
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    dst.append(p.grad)
                    src.append(view)
            if dst:
                torch._foreach_copy_(dst, src)

    # ----------------------------------------------------------------- errors
    def _raise_ready_twice(self, i: int) -> None:
        raise ReducerError(
            f"parameter '{self.names[i]}' was marked ready twice in one iteration: its gradient "
            "arrived after it had already been reduced (a second backward through the same "
            "forward, a parameter used outside forward(), or reentrant checkpointing) — run "
            "one forward per backward through the DDP model, or accumulate with no_sync()"
        )

    def _launch_despite_missing_gradients(self) -> None:
        """Some gradients never came: still send every bucket, with this rank's flag raised.

        The other ranks are waiting in those all-reduces; sending them keeps every
        rank in step, and the flag tells all of them to stop with an error.
        """
        with torch.no_grad():
            for i in range(len(self.params)):
                if not self._ready[i]:
                    self._view_of[i].zero_()
            self.buckets[-1].flags[dist.get_rank(self.group)] = 1
        for bucket in self.buckets[self._next_launch :]:
            bucket.pending = 0
        self._launch_ready_buckets()

    def _raise_if_any_rank_failed(self) -> None:
        if self._flags_work is not None:
            self._flags_work.wait()
            self._flags_work = None
        flags = self.buckets[-1].flags
        if not bool(flags.any()):
            return
        failed = [r for r, f in enumerate(flags.tolist()) if f != 0]
        flags.zero_()
        if not all(self._ready):
            self._raise_missing_gradients(failed)
        raise ReducerError(
            f"rank(s) {failed} received no gradient for some parameters in this backward (their "
            "own error names them) — pass find_unused_parameters=True to "
            "DistributedDataParallel if some parameters are legitimately unused on some ranks"
        )

    def _raise_missing_gradients(self, failed: list[int] | None = None) -> None:
        missing = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
        shown = ", ".join(missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        where = f" (ranks with missing gradients: {failed})" if failed else ""
        raise ReducerError(
            f"{len(missing)} parameter(s) received no gradient in this backward{where}: {shown} — "
            "pass find_unused_parameters=True to DistributedDataParallel if some parameters "
            "are legitimately unused, or make sure every parameter contributes to the loss"
        )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
