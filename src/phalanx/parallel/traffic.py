"""What the collectives carried: one `Traffic` record that every path adds to.

Every collective phalanx issues is booked as a `Traffic`: DDP's bucket
all-reduces and its step signals, ZeRO-1/2's parameter all-gathers, ZeRO-2's
bucket reduce-scatters, stage 3's gathers and reduce-scatters, a comm hook's
collectives (PowerSGD's P and Q), local SGD / DiLoCo's averages. A `Traffic`
is a value that adds up (`a + b`, `later - earlier` for a window), so the
counters of each owner are a running sum of it and the Trainer logs one
record whatever the strategy.

What it holds, per rank: the payload (`gradient_bytes` + `other_bytes`: each
tensor's bytes, once per collective it was handed to), the collectives
issued, the seconds the training thread waited for them, and `wire_bytes`,
what ring algorithms send per rank for that payload: an all-reduce of b bytes
2(N-1)/N x b, a reduce-scatter, all-gather or (pipelined) broadcast
(N-1)/N x b. docs/trainer.md compares these with what a link really carried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

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
    """What one rank handed to collectives (and waited for): one launch, or a running sum."""

    collectives: int = 0
    gradient_bytes: int = 0
    """Payload bytes of gradients (bucket reductions, stage 3's reduce-scatters, a hook's)."""
    other_bytes: int = 0
    """Every other payload byte: parameters gathered or averaged, flags, maps, buffers."""
    wire_bytes: float = 0.0
    """What ring algorithms send per rank for the payload (an estimate, see the module)."""
    wait_s: float = 0.0
    """Seconds the training thread was blocked waiting for these collectives."""

    @property
    def bytes_sent(self) -> int:
        """Every payload byte this rank handed to collectives."""
        return self.gradient_bytes + self.other_bytes

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.collectives + other.collectives,
            self.gradient_bytes + other.gradient_bytes,
            self.other_bytes + other.other_bytes,
            self.wire_bytes + other.wire_bytes,
            self.wait_s + other.wait_s,
        )

    def __sub__(self, other: Traffic) -> Traffic:
        """What happened between two readings of one running sum (`later - earlier`)."""
        return Traffic(
            self.collectives - other.collectives,
            self.gradient_bytes - other.gradient_bytes,
            self.other_bytes - other.other_bytes,
            self.wire_bytes - other.wire_bytes,
            self.wait_s - other.wait_s,
        )

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

    @classmethod
    def of_tensor(
        cls, kind: Collective, tensor: torch.Tensor, world_size: int, *, gradients: bool
    ) -> Traffic:
        """One collective of `kind` over `tensor` (the whole: N blocks for a gather or a
        reduce-scatter), its bytes booked as gradients or as other bytes."""
        nbytes = tensor.numel() * tensor.element_size()
        if gradients:
            return cls.of(kind, world_size, gradient_bytes=nbytes)
        return cls.of(kind, world_size, other_bytes=nbytes)

    @classmethod
    def waited(cls, seconds: float) -> Traffic:
        """Only a wait: what the training thread spent blocked on collectives already booked."""
        return cls(wait_s=seconds)


NO_TRAFFIC = Traffic()


@dataclass
class TrafficCounter:
    """A running sum of `Traffic`: what one owner of collectives (a reducer, a ZeRO
    optimizer's gathers, a stage-3 unit, a hook's state, a periodic sync) handed to them."""

    traffic: Traffic = NO_TRAFFIC

    def add(self, traffic: Traffic) -> None:
        self.traffic += traffic


@dataclass
class ReducerStats(TrafficCounter):
    """Counters a user (or a test) can read to see what the reducer really did.

    `traffic` is every collective the wrapper issued (buckets, signals, buffers,
    Join), the bytes handed to them and the end of backward's wait for them.
    """

    sync_rounds: int = 0  # backward passes whose gradients were reduced
    shadow_rounds: int = 0  # synced iterations this rank only shadowed, out of batches (Join)
    buckets_launched: int = 0  # bucket collectives launched
    buckets_skipped: int = 0  # not sent, unused on every rank (skip_all_reduce_unused_params)
    rebuilds: int = 0  # bucket rebuilds: the one in arrival order, and bucket_cap_mb="auto"'s
    hook_bytes: str = ""
    """With a comm hook, where `gradient_bytes` came from: "hook" (it reported what it
    sent, GradBucket.record_sent) or "bucket" (it did not: the bucket's bytes, as if
    all-reduced). Empty without a hook."""

    # The counters docs/ddp.md names, read from the one record.
    @property
    def collectives(self) -> int:
        return self.traffic.collectives

    @property
    def gradient_bytes(self) -> int:
        return self.traffic.gradient_bytes

    @property
    def other_bytes(self) -> int:
        return self.traffic.other_bytes

    @property
    def bytes_sent(self) -> int:
        return self.traffic.bytes_sent

    @property
    def wire_bytes(self) -> float:
        return self.traffic.wire_bytes

    @property
    def comm_wait_s(self) -> float:
        return self.traffic.wait_s


class TimedWait:
    """Time one wait of the training thread: `with TimedWait() as w: work.wait()`.

    Every wait phalanx books (a collective, an offload window's pages) goes
    through this one clock: `w.seconds` for the counters, `w.start_ns` /
    `w.end_ns` (perf_counter_ns) for a timeline span, `w.traffic()` for a
    `TrafficCounter`. Nothing is booked if the wait raised.
    """

    __slots__ = ("end_ns", "start_ns")

    def __enter__(self) -> TimedWait:
        self.start_ns = time.perf_counter_ns()
        self.end_ns = self.start_ns
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end_ns = time.perf_counter_ns()

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def traffic(self) -> Traffic:
        """The wait as a `Traffic` of no bytes (`Traffic.waited`)."""
        return Traffic.waited(self.seconds)
