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
"""

from __future__ import annotations

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


class ReduceScatter(BucketReduction[ReduceScatterState]):
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

    def _layout(self, bucket: Bucket) -> ShardedFlat:
        layout = bucket.reduction_state
        if not isinstance(layout, ShardedFlat):
            layout = bucket.reduction_state = ShardedFlat.of(
                bucket.params, self.world_size, self.rank
            )
        return layout

    def launch(self, bucket: Bucket) -> ReduceScatterState:
        layout = self._layout(bucket)
        with torch.no_grad():
            send = layout.reduce_scatter_input([p.grad for p in bucket.params])
            scale_to_mean(send, self.divisor)
        for p in bucket.params:
            p.grad = None  # the full gradient is not needed again: free it now
        received = torch.empty(layout.block, dtype=send.dtype, device=send.device)
        return start_reduce_scatter(received, send, self.group)

    def finish(self, bucket: Bucket, handle: ReduceScatterState) -> None:
        self._outputs[bucket.index] = wait_reduce_scatter(handle, self.group)

    def traffic(self, bucket: Bucket, handle: ReduceScatterState, world_size: int) -> Traffic:
        """One reduce-scatter of the laid-out bucket (padding included: it is sent)."""
        return handle.traffic()

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
