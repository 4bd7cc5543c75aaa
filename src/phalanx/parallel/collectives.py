"""Every collective of the sharded paths (ZeRO 1-2's and stage 3's), with typed handles.

Two moves carry all of sharding: an all-gather makes whole tensors from
every rank's pieces, a reduce-scatter leaves each rank the sum of its own
piece of everyone's gradients. Both work on the wire layout of
phalanx.parallel.sharding (N blocks, block r for rank r). A started collective
is a NamedTuple naming what it holds alive (`AllGatherState`,
`ReduceScatterState`, as FSDP2 names them); `wait()` finishes it.

One scaling rule for every gradient average, DDP's and ZeRO's alike:
gradients are multiplied by 1/N (N: the ranks that average them) before the
sum, so the sum is the mean and nothing is divided afterwards
(`scale_to_mean`).

The collective per backend (every figure measured here, gloo on loopback,
33.6 MB gathered or reduce-scattered):
- all-gather: NCCL's own (`all_gather_single`). On gloo, one broadcast per
  rank, each of its block into its place of the output, all in flight at once:
  the same bytes as a ring all-gather (each block reaches the N-1 others), at
  16 ms against gloo's all-gather's 42 ms at 2 ranks, 31 against 79 at 4.
  (An all-reduce of a zero-filled buffer, which phalanx used before, sends
  twice the bytes: 31 and 70 ms.)
- reduce-scatter: NCCL's own. On gloo an all-reduce of the input and a copy of
  this rank's block: 33 ms against gloo's reduce-scatter's 56 at 2 ranks, 59
  against 93 at 4, and its sums are gloo's reduce-scatter's bit for bit, which
  keeps stage 3 on torch FSDP2's numbers under bf16 too (one reduce per block
  to its owner sends half the bytes and took 43 ms at 4 ranks, but sums in
  another order: a bf16 run then drifted from FSDP2's by 5e-4 in 4 steps). At 2
  ranks an exchange of blocks sums as gloo does with half the bytes and is faster
  alone, but made ZeRO-2 and stage 3 slower in training beside busy processes:
  docs/zero.md, "The collectives".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from phalanx.parallel.sharding import ShardedFlat
from phalanx.parallel.traffic import Collective, Traffic
from phalanx.runtime.live import LIVE_BACKEND

# all_gather_single / reduce_scatter_single are torch 2.13's names; the older ones
# (2.3-2.12) take the same arguments.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Works:
    """Several collectives in flight as one: `wait()` waits for them all, `get_future()`
    completes when the last one does."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([w.get_future() for w in self.works])

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


Pending = dist.Work | Works
"""A collective in flight: the backend's Work, or several of them as one (gloo's forms)."""


class AllGatherState(NamedTuple):
    """An all-gather in flight: `output` holds every rank's block once `work` is done."""

    work: Pending
    output: torch.Tensor


class ReduceScatterState(NamedTuple):
    """A reduce-scatter in flight: this rank's summed block is in `output` once waited for."""

    work: Pending
    output: torch.Tensor
    input: torch.Tensor
    """Kept alive until the collective is done (the backend reads it asynchronously)."""
    copy_from_input: bool
    """gloo's forms: the sum of this rank's block is in `input`, copied out at the wait."""

    def traffic(self) -> Traffic:
        """What it hands to the backend: the whole input, as a reduce-scatter, or on gloo
        as the all-reduce it really is (twice a reduce-scatter's bytes on the wire)."""
        kind = Collective.ALL_REDUCE if self.copy_from_input else Collective.REDUCE_SCATTER
        world_size = self.input.numel() // max(1, self.output.numel())
        return Traffic.of_tensor(kind, self.input, world_size, gradients=True)

    def is_completed(self) -> bool:
        """The backend is done with it: `wait_reduce_scatter` will not block."""
        return bool(self.work.is_completed())


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    """Gloo's collectives (live recovery's group hands each to a gloo group)."""
    return str(dist.get_backend(group)) in ("gloo", LIVE_BACKEND)


def scale_to_mean(tensor: torch.Tensor, ranks: int) -> torch.Tensor:
    """Multiply in place by 1/ranks: the sum over `ranks` ranks is then their mean."""
    if ranks != 1:
        tensor.mul_(1.0 / ranks)
    return tensor


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, list[int]]:
    """This rank's index in `group`, and the group's global ranks in order."""
    if group is None or group is dist.group.WORLD:
        return dist.get_rank(), list(range(dist.get_world_size()))
    return dist.get_rank(group), dist.get_process_group_ranks(group)


def start_all_gather(
    output: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup | None
) -> AllGatherState:
    """Every rank's `block` into `output`, rank after rank (async)."""
    if not is_gloo(group):
        return AllGatherState(_all_gather(output, block, group=group, async_op=True), output)
    me, ranks = _ranks(group)
    n = block.numel()
    own = output[me * n : (me + 1) * n]
    if block.data_ptr() != own.data_ptr():  # not written in place (own_block_input)
        own.copy_(block)
    works = [
        dist.broadcast(output[i * n : (i + 1) * n], src=src, group=group, async_op=True)
        for i, src in enumerate(ranks)
    ]
    return AllGatherState(Works(works), output)


def start_broadcast_pieces(
    flats: list[torch.Tensor], layout: ShardedFlat, group: dist.ProcessGroup | None
) -> Works:
    """gloo: an all-gather straight into the tensors (flattened, `layout`'s cut): each rank's
    piece of each tensor broadcast into its place. No buffer and no copy, but N collectives
    per tensor: for large tensors (ZeRO-1/2's parameter gather after the step)."""
    _, ranks = _ranks(group)
    works = []
    for flat, numel, chunk in zip(flats, layout.numels, layout.chunks):
        for r, src in enumerate(ranks):
            start = min(r * chunk, numel)
            stop = min(start + chunk, numel)
            if stop > start:
                works.append(dist.broadcast(flat[start:stop], src=src, group=group, async_op=True))
    return Works(works)


def wait_all_gather(state: AllGatherState) -> torch.Tensor:
    state.work.wait()
    return state.output


def start_reduce_scatter(
    output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None
) -> ReduceScatterState:
    """Sum `send` (N blocks) over the ranks; block r lands in rank r's `output` (async).

    On gloo: an all-reduce, and this rank's block copied out at the wait.
    """
    if not is_gloo(group):
        work = _reduce_scatter(output, send, group=group, async_op=True)
        return ReduceScatterState(work, output, send, False)
    return ReduceScatterState(dist.all_reduce(send, group=group, async_op=True), output, send, True)


def wait_reduce_scatter(state: ReduceScatterState, group: dist.ProcessGroup | None) -> torch.Tensor:
    state.work.wait()
    if state.copy_from_input:
        rank, n = dist.get_rank(group), state.output.numel()
        state.output.copy_(state.input[rank * n : (rank + 1) * n])
    return state.output


def all_gather(output: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The blocking form of `start_all_gather`."""
    wait_all_gather(start_all_gather(output, block, group))
