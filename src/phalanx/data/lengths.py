"""Every rank's dataset has the same length: one small tensor collective says so, or says
which rank holds what.

A `DistributedSampler` shards one dataset by index and works its shard out of
`len(dataset)` alone, so every rank must pass the same dataset. Ranks whose
datasets differ in length (each filtered its own copy, or read a file another
process was still writing) work out different shards: some samples are read
twice and others never, with no warning (96 samples against 92), or the ranks
count different numbers of steps and the longer ones wait in their next
collective for the whole timeout (96 against 80). The sampler cannot ask the
other ranks itself: it is sometimes made on one rank alone (an evaluation on rank
0), where a collective would never be answered. So the Trainer asks, when it
starts and when it evaluates, and a hand-written loop asks with
`check_same_length` (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Sized

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError

__all__ = ["check_same_length", "describe_lengths"]


def check_same_length(
    dataset: Sized,
    group: dist.ProcessGroup | None = None,
    what: str = "dataset",
    device: torch.device | None = None,
) -> int:
    """Collective over `group` (default: the whole job; every rank calls it): `len(dataset)`,
    the same on every rank, or a `ConfigurationError` on every rank naming each rank's
    length. `what` names the dataset in the message ("training set"); `device` is where
    the group's collectives take their tensors (default: this rank's GPU under NCCL, else
    the CPU)."""
    length = len(dataset)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return length
    # A tensor, not all_gather_object: nothing a peer sends is unpickled.
    device = device if device is not None else _device_for(group)
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    lengths = [int(t.item()) for t in gathered]
    if len(set(lengths)) > 1:
        ranks = [_global(group, r) for r in range(len(lengths))]
        raise ConfigurationError(
            f"the ranks' {what}s differ in length ({describe_lengths(dict(zip(ranks, lengths)))}) "
            f"— give every rank the same {what}: the sampler deals one dataset out by index, "
            "so different lengths would repeat some samples and skip others, or leave the "
            "ranks with different numbers of steps"
        )
    return length


def describe_lengths(lengths: dict[int, int]) -> str:
    """'rank 0: 96 samples; rank 1: 92', ranks of one length together ('ranks 0-2, 5: 96')."""
    by_length: dict[int, list[int]] = {}
    for rank, length in sorted(lengths.items()):
        by_length.setdefault(length, []).append(rank)
    parts = []
    for length, ranks in by_length.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {_spans(ranks)}: {length}")
    return "; ".join([f"{parts[0]} samples", *parts[1:]])


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 2 else ", ".join(map(str, s)) for s in spans)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """The job-wide rank of `group`'s rank `rank` (itself for a group torch does not know,
    as live recovery's own groups)."""
    if group is None:
        return rank
    try:
        return dist.get_global_rank(group, rank)
    except (ValueError, RuntimeError):
        return rank


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this rank's GPU."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
