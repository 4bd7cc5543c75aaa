"""ZeRO stage 2: each bucket is reduce-scattered, so a rank receives only its own shard.

A `BucketReduction` for phalanx's reducer, installed by
`ZeroRedundancyOptimizer(..., shard_gradients=True)`. Buckets keep no flat
copy of their gradients: when a bucket is full, `launch` lays its
parameters' `.grad`s out rank by rank (each parameter's piece r in block r),
averages, frees the `.grad`s and starts one async reduce-scatter. The
output, 1/N of the bucket, is where each parameter's shard gradient then
lives. No full-size averaged gradient ever exists: the gradients of the
buckets not yet launched, and the reduce-scatter inputs in flight, are the
only full-size gradient memory.

Each launch first finishes the reduce-scatters already done, oldest first,
and lays its bucket out in an input one of them gave back (`Staging`: two at
most, the largest, kept across steps). Fresh inputs every launch, all alive
until the end of backward, cost the GPT of benchmarks/zero_memory.py 50k page
faults and 70 ms a step. Kept across steps, the two inputs are the only
gradient-sized memory ZeRO-2 holds between steps (ZeRO-1 holds every bucket);
let go at the end of each backward instead, their page faults made ZeRO-2
1.075x ZeRO-1's step on the GPT and 1.288x on the 8.4M MLP beside two busy
processes, against 1.004x and 1.008x kept (docs/zero.md, "The collectives").
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from phalanx.ddp.buckets import Bucket
from phalanx.ddp.reductions import BucketReduction
from phalanx.parallel.collectives import (
    ReduceScatterState,
    scale_to_mean,
    start_reduce_scatter,
    wait_reduce_scatter,
)
from phalanx.parallel.sharding import Piece, ShardedFlat
from phalanx.parallel.traffic import Traffic


class ShardOf(NamedTuple):
    """Where a parameter's reduced gradient goes: this rank's shard of it, and which piece."""

    shard: torch.Tensor
    piece: Piece


class Staging:
    """Reduce-scatter inputs given back once their collective was done, for the next
    launches to lay their buckets out in: at most `keep`, the largest."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`numel` elements: a kept input's first ones, or new memory."""
        for i, buffer in enumerate(self.free):
            if buffer.numel() >= numel and buffer.dtype == dtype and buffer.device == device:
                return self.free.pop(i)[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        self.free.append(base)
        self.free.sort(key=lambda t: t.numel(), reverse=True)
        del self.free[self.keep :]


class ScatterInFlight:
    """A bucket's reduce-scatter, and its averaged shard once finished (early or at the end)."""

    def __init__(self, state: ReduceScatterState) -> None:
        self.state = state
        self.received: torch.Tensor | None = None


class ReduceScatter(BucketReduction[ScatterInFlight]):
    """Average each bucket into the owners' shard gradients with one reduce-scatter."""

    keeps_gradients = False

    def __init__(self, group: dist.ProcessGroup, shards: dict[int, ShardOf]) -> None:
        """`shards`: id(parameter) -> (this rank's shard of it, which piece that is)."""
        super().__init__(dist.get_world_size(group))
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shards = shards
        self._outputs: dict[int, torch.Tensor] = {}
        self._in_flight: deque[ScatterInFlight] = deque()
        self._staging = Staging()

    def _layout(self, bucket: Bucket) -> ShardedFlat:
        layout = bucket.reduction_state
        if not isinstance(layout, ShardedFlat):
            layout = bucket.reduction_state = ShardedFlat.of(
                bucket.params, self.world_size, self.rank
            )
        return layout

    def start_iteration(self) -> None:
        self._in_flight.clear()  # an interrupted backward's: never waited for (a lost peer)

    def launch(self, bucket: Bucket) -> ScatterInFlight:
        while self._in_flight and self._in_flight[0].state.is_completed():
            self._complete(self._in_flight.popleft())
        layout = self._layout(bucket)
        grads = [p.grad for p in bucket.params]
        dtype = next((g.dtype for g in grads if g is not None), layout.dtype)
        with torch.no_grad():
            send = self._staging.take(layout.block * self.world_size, dtype, layout.device)
            layout.reduce_scatter_input(grads, dtype, out=send)
            scale_to_mean(send, self.divisor)
        for p in bucket.params:
            p.grad = None  # the full gradient is not needed again: free it now
        received = torch.empty(layout.block, dtype=send.dtype, device=send.device)
        in_flight = ScatterInFlight(start_reduce_scatter(received, send, self.group))
        self._in_flight.append(in_flight)
        return in_flight

    def _complete(self, in_flight: ScatterInFlight) -> None:
        in_flight.received = wait_reduce_scatter(in_flight.state, self.group)
        self._staging.give_back(in_flight.state.input)

    def finish(self, bucket: Bucket, handle: ScatterInFlight) -> None:
        # Buckets launch and finish in the same order: any older one left was finished first.
        while handle.received is None:
            self._complete(self._in_flight.popleft())
        self._outputs[bucket.index] = handle.received

    def traffic(self, bucket: Bucket, handle: ScatterInFlight, world_size: int) -> Traffic:
        """One reduce-scatter of the laid-out bucket (padding included: it is sent)."""
        return handle.state.traffic()

    def write_back(self, bucket: Bucket, skip: set[int]) -> None:
        """Each piece of the output becomes (or adds to) its parameter's shard gradient."""
        received = self._outputs.pop(bucket.index)
        pieces = self._layout(bucket).piece_views(received)
        for i, p, piece in zip(bucket.param_indices, bucket.params, pieces):
            if i in skip:
                continue  # no rank used it: its shard keeps no gradient, as in DDP
            shard = self.shards[id(p)].shard
            if shard.grad is None:
                shard.grad = piece
            else:  # a second synced backward before the step accumulates, as .grad would
                shard.grad.add_(piece)
