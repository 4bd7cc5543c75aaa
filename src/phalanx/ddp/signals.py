"""What every rank must learn at the end of a synced backward: who failed, what was used.

A rank that misses gradients cannot simply raise: the others are waiting in
that iteration's bucket collectives and would hang. So it sends its buckets
anyway (with zeros where gradients are missing) and raises its *flag*; every
rank then learns from the same message that some rank failed, and all of
them raise. With unused-parameter tracking, the same message carries the
used map, so parameters that no rank used keep their `.grad` untouched.

Where the flags travel:
- in the last bucket, when the reduction sums the whole buffer (the default
  all-reduce): free, no extra collective;
- otherwise in one small all-reduce issued after every bucket has finished,
  never beside one. A comm hook may chain collectives inside future callbacks
  (PowerSGD does), at times no rank controls; a message sent while such a
  chain runs would pair with different collectives on different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.parallel.traffic import Collective, ReducerStats, Traffic


@dataclass(frozen=True)
class StepOutcome:
    """What the ranks told each other about one synced backward."""

    failed_ranks: list[int]
    """Ranks that missed gradients (their own error names the parameters)."""
    used_counts: list[int] | None
    """Per parameter, how many ranks gave it a gradient; None when not tracked."""


class StepSignals:
    """The missing-gradient flags and the used map: laid out, raised and exchanged here only."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, stats: ReducerStats) -> None:
        self.group = group
        self.stats = stats
        """Where what is sent here is counted (the reducer's counters)."""
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self._missing_here = False

    def raise_flag(self, carrier: torch.Tensor | None) -> None:
        """This rank misses gradients; `carrier` is the last bucket's flag slots if they ride."""
        self._missing_here = True
        if carrier is not None:
            carrier[self.rank] = 1

    def agree(self, mine: list[bool]) -> list[bool]:
        """Which of this rank's `mine` are true on every rank (one small all-reduce)."""
        votes = torch.tensor(mine, dtype=torch.int32).to(self.device)
        dist.all_reduce(votes, group=self.group)
        self._count(votes)
        return [n == self.world_size for n in votes.tolist()]

    def agree_max(self, mine: int) -> int:
        """The largest of every rank's `mine` (one small all-reduce)."""
        value = torch.tensor([mine], dtype=torch.int64).to(self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        self._count(value)
        return int(value.item())

    def exchange(self, carrier: torch.Tensor | None, used: bytearray | None) -> StepOutcome:
        """After every bucket finished: send what did not ride in a bucket, read everything.

        `carrier`: the last bucket's flag slots, already summed by its collective,
        or None when the flags must travel here. `used`: this rank's used map, or
        None when unused parameters are not tracked.
        """
        parts: list[torch.Tensor] = []
        if carrier is None:
            mine = torch.zeros(self.world_size, dtype=torch.int32)
            mine[self.rank] = int(self._missing_here)
            parts.append(mine)
        if used is not None:
            parts.append(torch.frombuffer(bytearray(used), dtype=torch.uint8).to(torch.int32))
        counts: list[int] = []
        if parts:
            message = torch.cat(parts).to(self.device)
            dist.all_reduce(message, group=self.group)
            self._count(message)
            counts = message.tolist()
        if carrier is None:
            flags, counts = counts[: self.world_size], counts[self.world_size :]
        else:
            flags = carrier.tolist()
            if any(flags):  # zeros already otherwise: one torch call less per step
                carrier.zero_()
        self._missing_here = False
        return StepOutcome(
            failed_ranks=[r for r, f in enumerate(flags) if f != 0],
            used_counts=counts if used is not None else None,
        )

    def _count(self, message: torch.Tensor) -> None:
        nbytes = message.numel() * message.element_size()
        self.stats.add(Traffic.of(Collective.ALL_REDUCE, self.world_size, other_bytes=nbytes))
