"""Which tensors a fractional disk offload puts in files, and which it keeps in memory.

`DiskOffloadPolicy(fraction=f)` puts about a share f of the offloadable bytes
in files: at stage 3 the optimizer state, the shards and their gradients; at
stages 1-2 the optimizer state. Two orders (docs/zero.md, "Fractional offload",
measures them):

- "coldest" (the default): the optimizer state first, then the shards with
  their gradients. Per step a byte of state is read and written once, by the
  optimizer; a byte of shard is read by the forward's gather, the backward's
  gather and the optimizer, and written by the optimizer, and its gradient is
  written by the reduce-scatter and read by the optimizer: the state is the
  coldest, so the same bytes out of memory cost the least I/O there.
- "largest": whole parameters (their shard, gradient and state together),
  largest first: the rule of FSDP2's `cpu_offload_by_budget` (pytorch#188120).

Within a kind the largest tensors go first: every byte of one kind costs the
same I/O per step, so size only decides how many files and system calls
carry it, and the fewest large ones carry it cheapest. The shards' share is
fixed when the model is sharded, before the optimizer exists, so it assumes
Adam's two moments (`STATE_PER_PARAM_BYTE`): half of stage 3's offloadable
bytes are state, and a fraction up to 1/2 keeps every shard in memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, TypeVar

__all__ = ["STATE_PER_PARAM_BYTE", "Order", "largest_first", "shard_share", "state_share"]

Order = Literal["coldest", "largest"]
K = TypeVar("K", bound=Hashable)

STATE_PER_PARAM_BYTE = 2.0
"""Bytes of optimizer state per byte of parameter assumed when the shards' share is set
(Adam's and AdamW's two moments, the Trainer's optimizer)."""
SHARD_PER_PARAM_BYTE = 2.0
"""Stage 3 offloads a parameter's shard and its gradient: two bytes per byte of shard."""


def shard_share(fraction: float, order: Order) -> float:
    """The share of the shards' bytes (with their gradients) to put in files at stage 3."""
    if order == "largest":
        return fraction
    state, shards = STATE_PER_PARAM_BYTE, SHARD_PER_PARAM_BYTE
    return min(1.0, max(0.0, (fraction * (state + shards) - state) / shards))


def state_share(fraction: float, order: Order, shards_offloadable: bool) -> float:
    """The share of the optimizer state's bytes to put in files (`shards_offloadable`: stage 3
    with the shards under the same policy, so they take part of the fraction)."""
    if order == "largest" or not shards_offloadable:
        return fraction
    state, shards = STATE_PER_PARAM_BYTE, SHARD_PER_PARAM_BYTE
    return min(1.0, fraction * (state + shards) / state)


def largest_first(sizes: Sequence[tuple[K, int]], share: float) -> set[K]:
    """The keys of the largest entries whose bytes reach `share` of the total (at least it:
    a budget is met, not missed); equal sizes in the order given, so every rank, given the
    same sizes, picks the same."""
    total = sum(n for _, n in sizes)
    if share >= 1.0:
        return {key for key, _ in sizes}
    target = share * total
    chosen: set[K] = set()
    taken = 0
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i)):
        if taken >= target:
            break
        key, nbytes = sizes[index]
        chosen.add(key)
        taken += nbytes
    return chosen
