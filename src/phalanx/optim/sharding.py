"""How ZeRO cuts parameters into shards, and how the shards travel.

Every parameter is cut, not placed: its flattened elements are split into N
contiguous pieces exactly as `torch.chunk` splits them (pieces of
ceil(numel / N), the last ones shorter or empty), and rank r keeps piece r.
So each rank holds 1/N of every tensor, however unevenly the model spreads
its parameters over tensors, and a rank's piece of a parameter is one
contiguous range: its optimizer state is a real tensor the optimizer class
steps, and the same split is a DTensor `Shard(0)` placement, which
torch.distributed.checkpoint saves and reshards to another world size.

Collectives need equal sizes from every rank, so on the wire each piece is
padded to the full chunk: a flat buffer holds, rank after rank, every
parameter's padded piece. `ShardedFlat` describes that layout for a list of
parameters and moves data between it and the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class Piece:
    """One rank's contiguous range of a flattened tensor of `numel` elements."""

    numel: int
    chunk: int
    """ceil(numel / N): every rank's piece is padded to this on the wire."""
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def piece_of(numel: int, world_size: int, rank: int) -> Piece:
    """Rank `rank`'s piece, with torch.chunk's split (the one DTensor's Shard(0) uses)."""
    chunk = max(1, math.ceil(numel / world_size))
    start = min(rank * chunk, numel)
    return Piece(numel, chunk, start, min(start + chunk, numel))


class ShardedFlat:
    """The wire layout of a list of parameters: N blocks, each every parameter's padded piece.

    Block r of the flat buffer is what rank r sends in an all-gather (and
    receives in a reduce-scatter): for each parameter in order, its piece r
    padded to `chunk`. `offsets[i]` is where parameter i's piece starts in a block.
    """

    def __init__(
        self,
        numels: Sequence[int],
        world_size: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.world_size = world_size
        self.rank = rank
        self.numels = list(numels)
        self.pieces = [piece_of(n, world_size, rank) for n in self.numels]
        self.chunks = [p.chunk for p in self.pieces]
        self.offsets: list[int] = []
        offset = 0
        for chunk in self.chunks:
            self.offsets.append(offset)
            offset += chunk
        self.block = offset
        """Elements per rank on the wire."""

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], world_size: int, rank: int) -> ShardedFlat:
        """The layout of `tensors` (their sizes, dtype and device) across `world_size` ranks."""
        first = tensors[0]
        return cls([t.numel() for t in tensors], world_size, rank, first.dtype, first.device)

    def padded_rows(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's flattened values as (N, chunk), zero-padded at the end."""
        extra = self.world_size * self.chunks[i] - self.numels[i]
        if extra:
            flat = F.pad(flat, (0, extra))
        return flat.view(self.world_size, self.chunks[i])

    def reduce_scatter_input(self, flats: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The (N x block) input of a reduce-scatter: every tensor's pieces, block by block.

        A None (a parameter with no gradient) contributes zeros.
        """
        rows = []
        for i, flat in enumerate(flats):
            if flat is None:
                flat = torch.zeros(self.numels[i], dtype=self.dtype, device=self.device)
            rows.append(self.padded_rows(flat.reshape(-1), i))
        return torch.cat(rows, dim=1).view(-1)

    def own_block_input(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's block for an all-gather: its pieces, each padded to its chunk."""
        padded = []
        for i, piece in enumerate(pieces):
            extra = self.chunks[i] - piece.numel()
            padded.append(F.pad(piece, (0, extra)) if extra else piece)
        return torch.cat(padded) if len(padded) > 1 else padded[0].clone()

    def piece_views(self, block: torch.Tensor) -> list[torch.Tensor]:
        """This rank's pieces inside one block (its reduce-scatter output), as views."""
        return [
            block[offset : offset + piece.length]
            for offset, piece in zip(self.offsets, self.pieces)
        ]

    def copy_out(self, gathered: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
        """Write an all-gather's output (N blocks) back into the full `targets`, in place."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        strided: list[tuple[torch.Tensor, torch.Tensor]] = []  # e.g. channels_last weights
        blocks = gathered.view(self.world_size, self.block)
        for target, offset, numel, chunk in zip(targets, self.offsets, self.numels, self.chunks):
            if target.is_contiguous():
                flat = target.view(-1)
            else:
                flat = torch.empty(numel, dtype=target.dtype, device=target.device)
                strided.append((target, flat))
            for r in range(self.world_size):
                start = min(r * chunk, numel)
                stop = min(start + chunk, numel)
                if stop > start:
                    dst.append(flat[start:stop])
                    src.append(blocks[r, offset : offset + stop - start])
        if dst:
            torch._foreach_copy_(dst, src)
        for target, flat in strided:
            target.copy_(flat.view(target.shape))


class Pending:
    """A collective in flight, and what must happen to its result once it is done."""

    def __init__(self, work: Any, then: Callable[[], object] | None = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _gloo(group: dist.ProcessGroup | None) -> bool:
    return str(dist.get_backend(group)) == "gloo"


def all_gather_flat(
    output: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Pending:
    """Every rank's `block` into `output`, rank after rank.

    On gloo, as a sum of zero-padded blocks: its allreduce moves data about twice
    as fast as its allgather (measured here, 2 ranks, 188 MB out: 0.39 s against
    0.73 s), and x + 0 is exact. NCCL's all-gather is the real thing.
    """
    if _gloo(group):
        rank, n = dist.get_rank(group), block.numel()
        output.zero_()
        output[rank * n : (rank + 1) * n].copy_(block)
        pending = Pending(dist.all_reduce(output, group=group, async_op=True))
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        pending = Pending(gather(output, block, group=group, async_op=True))
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_flat(
    output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Pending:
    """Sum `send` (N blocks) across ranks; block r lands in rank r's `output`.

    On gloo, as an allreduce of `send` in place and a copy of this rank's block:
    faster there than its reduce-scatter (measured: 34 ms against 51 ms for a
    25 MB bucket at world 2, 73 against 111 at world 4).
    """
    if _gloo(group):
        rank, n = dist.get_rank(group), output.numel()
        work = dist.all_reduce(send, group=group, async_op=True)
        pending = Pending(work, lambda: output.copy_(send[rank * n : (rank + 1) * n]))
    else:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        pending = Pending(scatter(output, send, group=group, async_op=True))
    if not async_op:
        pending.wait()
    return pending
