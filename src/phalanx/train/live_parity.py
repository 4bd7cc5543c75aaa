"""Parity over the next k members: what keeps a lost rank's ZeRO pieces in 1/k of a piece.

Each member's snapshot of its pieces is one run of bytes (`runtime/wire.py`'s packed
layout), padded to the ring's longest and cut into k stripes of `stripe` bytes. Stripe t of
member i is added into the parity that member i+t+1 holds (around the ring), so member h
holds the sum of stripe j-1 of member h-j for j = 1..k: `stripe` bytes, 1/k of a piece.
The sum is bytewise modulo 256 (uint8, whose wrap-around C++ and both backends define):
exact, whatever the bytes mean, and gloo and NCCL both sum uint8 where neither has XOR.

When member i is lost, its stripe t is the parity at h = i+t+1 less the other
contributors' stripe of it, read from their own snapshots: every surviving member adds
what it holds into one buffer (`contribution`) and an all-reduce of that buffer is
member i's bytes, on every member at once. Any one loss among k+1 neighbours is covered;
k = 1 is a neighbour's whole copy. Design and costs: docs/reliability.md, "Sharded live
recovery".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.wire import as_bytes

__all__ = [
    "Fill",
    "contribution",
    "exchange",
    "from_pieces",
    "from_tensor",
    "holders",
    "needed",
    "redundancy_in",
    "stripe_bytes",
]

Fill = Callable[[int, torch.Tensor], None]
"""Fills a uint8 buffer with a member's snapshot bytes from an offset on, zeros past their
end (from memory, or through a file without mapping it: `PieceFiles.reader`)."""


def redundancy_in(ring_size: int, redundancy: int) -> int:
    """The k a ring of this many members uses: at most the others (0: a ring of one)."""
    return max(0, min(redundancy, ring_size - 1))


def stripe_bytes(longest: int, k: int) -> int:
    """Bytes of one stripe when the ring's longest snapshot is `longest` bytes."""
    return -(-longest // max(1, k))


def holders(lost: int, n: int, k: int) -> list[int]:
    """Ring indices of the members holding parity of member `lost`'s stripes, stripe order."""
    return [(lost + t + 1) % n for t in range(k)]


def needed(lost: int, n: int, k: int) -> set[int]:
    """Ring indices whose own snapshots rebuild member `lost`: every other contributor to
    the parities of its stripes."""
    return {(h - j) % n for h in holders(lost, n, k) for j in range(1, k + 1)} - {lost}


def from_tensor(flat: torch.Tensor) -> Fill:
    """A `Fill` over bytes in memory (a uint8 tensor)."""

    def fill(offset: int, out: torch.Tensor) -> None:
        have = max(0, min(out.numel(), flat.numel() - offset))
        if have:
            out[:have].copy_(flat[offset : offset + have])
        out[have:].zero_()

    return fill


def from_pieces(header: list[Any], pieces: dict[str, torch.Tensor]) -> Fill:
    """A `Fill` over named tensors as `runtime/wire.py`'s layout `header` lays them out,
    read from where they lie (no run of bytes made first)."""
    spans = [(int(offset), as_bytes(t)) for (_, _, _, offset), t in zip(header, pieces.values())]

    def fill(offset: int, out: torch.Tensor) -> None:
        out.zero_()
        stop = offset + out.numel()
        for start, raw in spans:
            low, high = max(offset, start), min(stop, start + raw.numel())
            if low < high:
                out[low - offset : high - offset].copy_(raw[low - start : high - start])

    return fill


def exchange(
    fill: Fill,
    stripe: int,
    k: int,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    part_bytes: int,
) -> None:
    """Fill `out` (`stripe` bytes) with the parity this member holds: the sum of its k
    predecessors' stripes for it, received while it sends its own k stripes (read with
    `fill`) to its k successors (collective; group rank = ring index). In parts of about
    `part_bytes` sent and as many received, never whole pieces in memory."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    targets = sorted((me + t + 1) % n for t in range(k))
    sources = {(me - j) % n for j in range(1, k + 1)}
    step = max(1, part_bytes // k)
    for start in range(0, stripe, step):
        size = min(stripe, start + step) - start
        send = torch.empty(size * k, dtype=torch.uint8)
        for slot, rank in enumerate(targets):  # in rank order, as the splits are
            fill(((rank - me - 1) % n) * stripe + start, send[slot * size : (slot + 1) * size])
        received = torch.empty(size * k, dtype=torch.uint8)
        dist.all_to_all_single(
            received,
            send,
            [size if r in sources else 0 for r in range(n)],
            [size if r in targets else 0 for r in range(n)],
            group=group,
        )
        out[start : start + size] = received.view(k, size).sum(0, dtype=torch.uint8)


def contribution(
    lost: int,
    me: int | None,
    n: int,
    k: int,
    stripe: int,
    own: Fill | None,
    parity: torch.Tensor | None,
) -> torch.Tensor:
    """What member `me` (a ring index; None: not in that ring) adds toward member `lost`'s
    bytes: the parity it holds of `lost`'s stripe, less its own stripe in that parity
    (read with `own`). The sum over every member (an all-reduce) is `lost`'s k * stripe
    bytes."""
    out = torch.zeros(k * stripe, dtype=torch.uint8)
    if me is None:
        return out
    mine = torch.empty(stripe, dtype=torch.uint8)
    for t, h in enumerate(holders(lost, n, k)):
        block = out[t * stripe : (t + 1) * stripe]
        if me == h:
            assert parity is not None, "a holder without the parity choose() counted on"
            block.add_(parity)
        for j in range(1, k + 1):
            if j != t + 1 and (h - j) % n == me:
                assert own is not None, "a contributor without the snapshot choose() counted on"
                own((j - 1) * stripe, mine)
                block.sub_(mine)
    return out
