"""What the reducer really did: counters a user, a test or the Trainer's log can read.

Besides the iteration counts, every byte the wrapper hands to a collective is
counted here, split in two: the gradients (what the bucket reductions send)
and everything else (the missing-gradient flags, the used map, the bucket
agreement, buffer broadcasts, the Join message). Next to the bytes handed
over, `wire_bytes` estimates what the network carries per rank for them,
assuming ring algorithms: an all-reduce of b bytes sends 2(N-1)/N x b from
each rank, a reduce-scatter or all-gather (N-1)/N x b, a pipelined broadcast
about (N-1)/N x b on average.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class Collective(Enum):
    """The kinds of collective whose wire cost differs."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"


def ring_wire_bytes(kind: Collective, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective over `nbytes`, with ring algorithms."""
    share = (world_size - 1) / world_size if world_size > 0 else 0.0
    return (2 * share if kind is Collective.ALL_REDUCE else share) * nbytes


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one launch handed to collectives."""

    collectives: int
    gradient_bytes: int
    other_bytes: int
    wire_bytes: float
    source: str = ""
    """For a comm hook's bucket: "hook" if it reported what it sent, else "bucket"."""

    @classmethod
    def of(
        cls,
        kind: Collective,
        world_size: int,
        *,
        gradient_bytes: int = 0,
        other_bytes: int = 0,
        collectives: int = 1,
    ) -> Traffic:
        """One or more collectives of `kind` over these bytes in all."""
        wire = ring_wire_bytes(kind, gradient_bytes + other_bytes, world_size)
        return cls(collectives, gradient_bytes, other_bytes, wire)


NO_TRAFFIC = Traffic(0, 0, 0, 0.0)


@dataclass
class ReducerStats:
    """Counters a user (or a test) can read to see what the reducer really did."""

    sync_rounds: int = 0  # backward passes whose gradients were reduced
    shadow_rounds: int = 0  # synced iterations this rank only shadowed, out of batches (Join)
    buckets_launched: int = 0  # bucket collectives launched
    buckets_skipped: int = 0  # not sent, unused on every rank (skip_all_reduce_unused_params)
    collectives: int = 0  # every collective the wrapper issued (buckets, signals, buffers, Join)
    gradient_bytes: int = 0  # bytes of gradients handed to bucket collectives
    other_bytes: int = 0  # flags, used map, bucket agreement, buffer broadcasts, Join messages
    wire_bytes: float = 0.0  # what ring algorithms send per rank for all of the above
    hook_bytes: str = ""
    """With a comm hook, where `gradient_bytes` came from: "hook" (it reported what it
    sent, GradBucket.record_sent) or "bucket" (it did not: the bucket's bytes, as if
    all-reduced). Empty without a hook."""
    comm_wait_s: float = 0.0  # time spent waiting on communication at the end of backward
    rebuilds: int = 0  # bucket rebuilds: the one in arrival order, and bucket_cap_mb="auto"'s

    @property
    def bytes_sent(self) -> int:
        """Every byte this rank handed to the wrapper's collectives."""
        return self.gradient_bytes + self.other_bytes

    def add(self, traffic: Traffic) -> None:
        self.collectives += traffic.collectives
        self.gradient_bytes += traffic.gradient_bytes
        self.other_bytes += traffic.other_bytes
        self.wire_bytes += traffic.wire_bytes
        if traffic.source:
            self.hook_bytes = traffic.source


@dataclass
class CommCounter:
    """What one owner of collectives handed to them, and how long training waited for them:
    a ZeroRedundancyOptimizer's parameter all-gathers, a fully_shard unit's gathers and
    reduce-scatters. The Trainer sums these with the reducer's (`comm_bytes_per_step`)."""

    collectives: int = 0
    bytes_sent: int = 0
    wire_bytes: float = 0.0
    wait_s: float = 0.0
    """Seconds the training thread was blocked waiting for these collectives."""

    def add(self, traffic: Traffic) -> None:
        self.collectives += traffic.collectives
        self.bytes_sent += traffic.gradient_bytes + traffic.other_bytes
        self.wire_bytes += traffic.wire_bytes

    def count(self, kind: Collective, tensor: torch.Tensor, world_size: int) -> None:
        """One collective of `kind` over `tensor` (the whole, N blocks), across `world_size`."""
        nbytes = tensor.numel() * tensor.element_size()
        if kind is Collective.ALL_GATHER:  # parameters, not gradients
            self.add(Traffic.of(kind, world_size, other_bytes=nbytes))
        else:
            self.add(Traffic.of(kind, world_size, gradient_bytes=nbytes))
