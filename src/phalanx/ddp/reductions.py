"""What a full bucket does: the strategy that reduces it across ranks.

The reducer fills buckets and launches them in order; which collective a
launch starts, and how its result lands back in the bucket, is decided here
and nowhere else. A new way to reduce (a comm hook, a reduce-scatter for
sharded gradients) is a new `BucketReduction`: the per-parameter hook path
does not change. The strategy only tells the hook path one thing up front,
`slot_scale`: a factor to apply while copying gradients in, so the default
path averages without a second pass over the bucket.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from phalanx.ddp.buckets import Bucket
from phalanx.ddp.comm_hooks import CommHook, GradBucket
from phalanx.ddp.comm_stats import HookState, process_group_of, stats_of
from phalanx.parallel.traffic import NO_TRAFFIC, Collective, Traffic

HandleT = TypeVar("HandleT")
"""What a reduction's launch returns and its finish takes: torch's Work for the all-reduce,
a Future for a comm hook, a ReduceScatterState for ZeRO-2's reduce-scatter."""


@dataclass(frozen=True, slots=True)
class InFlight(Generic[HandleT]):
    """A bucket's collective in flight, beside the reduction that started it, so its
    handle only ever goes back to that reduction (FSDP2 names its states the same way)."""

    reduction: BucketReduction[HandleT]
    handle: HandleT

    def finish(self, bucket: Bucket) -> None:
        """Wait; afterwards `bucket.grads` (or the reduction's own output) holds the result."""
        self.reduction.finish(bucket, self.handle)

    def traffic(self, bucket: Bucket, world_size: int) -> Traffic:
        """What the launch handed to collectives (asked once `finish` returned)."""
        return self.reduction.traffic(bucket, self.handle, world_size)

    def future(self) -> torch.futures.Future[Any] | None:
        """A future completed with the collective, for the timeline (None: unknown)."""
        return self.reduction.future(self.handle)


class BucketReduction(ABC, Generic[HandleT]):
    """Starts a bucket's collective, and finishes it into the bucket's `grads`."""

    carries_flags: bool = False
    """True when the collective sends the whole `bucket.buffer`, flag slots included, and
    sums them: the missing-gradient flags then ride in the last bucket for free."""
    keeps_gradients: bool = True
    """True: buckets hold a flat copy of their gradients, which `launch` sends. False:
    buckets only count readiness, and `launch` reads each parameter's `.grad` itself."""

    def __init__(self, divisor: int) -> None:
        self.divisor = divisor
        """The ranks a bucket's sum is averaged over: the group's size, or under Join with
        divide_by_initial_world_size=False the ranks still training (`set_divisor`)."""

    def slot_scale(self) -> torch.Tensor | None:
        """Multiply gradients by this while copying them into a bucket; None copies as is."""
        return None

    def start_iteration(self) -> None:
        """A synced backward begins: forget what an interrupted one left in flight."""

    def set_divisor(self, divisor: int) -> None:
        """Average over `divisor` ranks from now on: every reduction reads `self.divisor`."""
        self.divisor = divisor

    def start(self, bucket: Bucket) -> InFlight[HandleT]:
        """Launch a full bucket's collective; what the bucket holds until it is finished."""
        return InFlight(self, self.launch(bucket))

    @abstractmethod
    def launch(self, bucket: Bucket) -> HandleT:
        """Start the collective for a full bucket; return what `finish` needs."""

    @abstractmethod
    def finish(self, bucket: Bucket, handle: HandleT) -> None:
        """Wait for `handle`; afterwards `bucket.grads` holds the reduced gradients."""

    def write_back(self, bucket: Bucket, skip: set[int]) -> None:
        """Hand the reduced gradients to where the optimizer reads them (default: `.grad`),
        except for the parameters in `skip` (reducer indices: unused on every rank)."""
        bucket.write_back(skip)

    @property
    def traffic_source(self) -> str:
        """Where a comm hook's booked bytes come from (ReducerStats.hook_bytes); "" otherwise."""
        return ""

    def traffic(self, bucket: Bucket, handle: HandleT, world_size: int) -> Traffic:
        """What this launch handed to collectives, asked once `finish` returned (counters).

        Default: one all-reduce of the bucket's gradients.
        """
        return Traffic.of(Collective.ALL_REDUCE, world_size, gradient_bytes=bucket.grad_bytes)

    def future(self, handle: HandleT) -> torch.futures.Future[Any] | None:
        """A future completed with the collective, for the timeline (None: unknown)."""
        return None


class AllReduce(BucketReduction[dist.Work]):
    """The default: average the whole buffer with one async all-reduce (torch DDP's path)."""

    carries_flags = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(dist.get_world_size(group))
        self.group = group
        # A 0-dim tensor, not a float: torch.mul with a Python scalar costs twice as
        # much per call, and the hook path calls it once per parameter per step.
        self._inverse_divisor = torch.tensor(1.0 / self.divisor)
        # The process group's own call, as dist.all_reduce makes it after its checks
        # (a bucket is a plain dense tensor of a rank in the group): its Python runs
        # once per bucket per step, cold after the backward's kernels.
        self._options = dist.AllreduceOptions()  # reduceOp: SUM by default
        self._options.asyncOp = True

    def slot_scale(self) -> torch.Tensor:
        return self._inverse_divisor

    def set_divisor(self, divisor: int) -> None:
        if divisor != self.divisor:
            super().set_divisor(divisor)
            self._inverse_divisor.fill_(1.0 / divisor)  # in place: the buckets hold this tensor

    def launch(self, bucket: Bucket) -> dist.Work:
        if not bucket.scaled:
            # Raw sums in the slots (gradient_as_bucket_view accumulates in place;
            # batched_grad_copy copies unscaled): average them now, dividing as
            # torch's reducer does on these paths, so the result is its bit for bit.
            bucket.grads.div_(self.divisor)
        if bucket.buffer.is_complex():  # sent as real pairs, dist.all_reduce's way
            return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        return self.group.allreduce([bucket.buffer], self._options)

    def finish(self, bucket: Bucket, handle: dist.Work) -> None:
        handle.wait()

    def traffic(self, bucket: Bucket, handle: dist.Work, world_size: int) -> Traffic:
        return _all_reduce_traffic(world_size, bucket.grad_bytes, bucket.flags.nbytes)

    def future(self, handle: dist.Work) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = handle.get_future()
        return future


@functools.lru_cache(maxsize=256)
def _all_reduce_traffic(world_size: int, grad_bytes: int, flag_bytes: int) -> Traffic:
    """A bucket's traffic is the same every step: made once per layout, not per bucket per step."""
    return Traffic.of(
        Collective.ALL_REDUCE, world_size, gradient_bytes=grad_bytes, other_bytes=flag_bytes
    )


HookFuture = torch.futures.Future[Any]
"""A comm hook's handle: the future it returned."""


class CommHookReduction(BucketReduction[HookFuture]):
    """A user's `register_comm_hook(state, hook)`: the hook owns the wire format.

    It gets the bucket's raw gradient sums and returns a Future of the averaged
    flat tensor, exactly as torch's comm hooks do, so torch's hooks work too.

    Buckets go through the hook one after another: bucket k's hook starts when
    bucket k-1's future is done. A hook may issue more collectives from its
    future's callbacks (PowerSGD does), and on gloo those callbacks run on a
    communication thread at a time no rank controls; started beside them,
    the next bucket's collective would be paired with a different one on each
    rank. (On NCCL a future is done once its work is enqueued, so the chain
    runs inline and nothing waits.)
    """

    def __init__(self, hook: CommHook, state: Any) -> None:
        super().__init__(process_group_of(state).size())
        self.hook = hook
        self.state = state
        self._previous: HookFuture | None = None
        self._hook_stats = stats_of(state)
        """The hook's own counters when its state is a HookState (what it really sent)."""
        self._booked = NO_TRAFFIC
        """What of _hook_stats the reducer has booked already."""

    def set_divisor(self, divisor: int) -> None:
        """Handed on to the hook's HookState, which phalanx's hooks divide by; torch's hooks
        (a process group as state) divide by the group's size, as under torch's Join."""
        super().set_divisor(divisor)
        if isinstance(self.state, HookState):
            self.state.divisor = divisor

    def launch(self, bucket: Bucket) -> HookFuture:
        if bucket.index == 0 and self._hook_stats is not None:
            # Every earlier bucket is booked by now: what the counters gained since came
            # from elsewhere (a resume restored them) and is no traffic of this run's.
            self._booked = self._hook_stats.traffic
        grad_bucket = GradBucket(
            bucket.index, bucket.grads, bucket.params, bucket.views, bucket.is_last
        )
        previous = self._previous
        if previous is None or previous.done():
            future = self.hook(self.state, grad_bucket)
        else:
            future = torch.futures.Future()
            previous.add_done_callback(lambda _: self._start_after(grad_bucket, future))
        self._previous = future
        return future

    def _start_after(self, grad_bucket: GradBucket, result: HookFuture) -> None:
        """Run the hook now that the previous bucket is done; forward its outcome to `result`."""
        try:
            inner = self.hook(self.state, grad_bucket)
        except Exception as exc:  # surfaces in the reducer's wait, on the training thread
            result.set_exception(exc)
            return

        def forward(done: HookFuture) -> None:
            try:
                result.set_result(done.value())
            except Exception as exc:
                result.set_exception(exc)

        inner.add_done_callback(forward)

    def finish(self, bucket: Bucket, handle: HookFuture) -> None:
        handle.wait()
        result = handle.value()
        if isinstance(result, list):
            result = result[0]
        if result is not bucket.grads:
            bucket.grads.copy_(result)

    @property
    def traffic_source(self) -> str:
        """ "hook" when the hook counts what it sends (a HookState), else "bucket"."""
        return "bucket" if self._hook_stats is None else "hook"

    def traffic(self, bucket: Bucket, handle: HookFuture, world_size: int) -> Traffic:
        """What the hook counted in its `HookState.stats` since the last bucket was booked
        (its chained collectives are done once the bucket is); a hook without one (torch's
        own, a process group as state) is booked as an all-reduce of the bucket."""
        stats = self._hook_stats
        if stats is None:
            return super().traffic(bucket, handle, world_size)
        booked, self._booked = self._booked, stats.traffic
        return stats.traffic - booked

    def future(self, handle: HookFuture) -> HookFuture:
        future: HookFuture = handle
        return future
