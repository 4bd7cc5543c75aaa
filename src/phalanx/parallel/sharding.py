"""How ZeRO cuts parameters into pieces, and the wire layout the pieces travel in.

Every parameter is cut, not placed: split into N contiguous pieces exactly
as `torch.chunk` splits it (pieces of ceil(rows / N) rows, the last ones
shorter or empty), and rank r keeps piece r. So each rank holds 1/N of
every tensor, however unevenly the model spreads its parameters over
tensors, and a rank's piece of a parameter is one contiguous range of its
flattened elements. Two granularities, one code path (`row`: elements per row):

- ZeRO-1/2 cut the flattened tensor (`row=1`): its optimizer state is a 1-D
  tensor, saved as a `Shard(0)` DTensor of the flattened parameter;
- stage 3 cuts dim 0 (`row` = elements of one dim-0 slice), FSDP2's split: a
  piece is the rows a `Shard(0)` DTensor of the parameter holds locally.

Collectives need equal sizes from every rank, so on the wire each piece is
padded to the full chunk: a flat buffer holds, rank after rank, every
parameter's padded piece. `ShardedFlat` describes that layout for a list of
parameters and moves data between it and the parameters; the collectives
themselves are in phalanx.parallel.collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phalanx.parallel.traffic import Collective, Traffic


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


def piece_of(numel: int, world_size: int, rank: int, row: int = 1) -> Piece:
    """Rank `rank`'s piece, with torch.chunk's split of the rows (DTensor's Shard(0) split).

    `row`: elements per row (1 cuts the flattened tensor). Element offsets come back.
    """
    rows = numel // row if row else 0
    chunk_rows = max(1, math.ceil(rows / world_size))
    start = min(rank * chunk_rows, rows)
    stop = min(start + chunk_rows, rows)
    return Piece(numel, chunk_rows * row, start * row, stop * row)


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 slice of a tensor of `shape` (stage 3's row)."""
    return math.prod(shape[1:])


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
        rows: Sequence[int] | None = None,
    ) -> None:
        """`rows`: each tensor's elements per row (stage 3's dim-0 cut); None cuts flat."""
        self.dtype = dtype
        self.device = device
        self.world_size = world_size
        self.rank = rank
        self.numels = list(numels)
        row_sizes = list(rows) if rows is not None else [1] * len(self.numels)
        self.pieces = [piece_of(n, world_size, rank, r) for n, r in zip(self.numels, row_sizes)]
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
        """The flat-cut layout of `tensors` (sizes, dtype, device) over `world_size` ranks."""
        first = tensors[0]
        return cls([t.numel() for t in tensors], world_size, rank, first.dtype, first.device)

    def gather_traffic(self, world_size: int) -> Traffic:
        """An all-gather of these tensors (unpadded: what piece-wise broadcasts send)."""
        nbytes = sum(self.numels) * self.dtype.itemsize
        return Traffic.of(Collective.ALL_GATHER, world_size, other_bytes=nbytes)

    def padded_rows(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's flattened values as (N, chunk), zero-padded at the end."""
        extra = self.world_size * self.chunks[i] - self.numels[i]
        if extra:
            flat = F.pad(flat, (0, extra))
        return flat.view(self.world_size, self.chunks[i])

    def reduce_scatter_input(
        self,
        flats: Sequence[torch.Tensor | None],
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The (N x block) input of a reduce-scatter: every tensor's pieces, block by block.

        A None (a parameter with no gradient) contributes zeros. `dtype`: of the
        result (default: the layout's); the flats must already be in it. `out`: memory to
        lay it out in (N x block elements, contiguous), instead of a new tensor.
        """
        dtype = dtype or self.dtype
        rows = []
        for i, flat in enumerate(flats):
            if flat is None:
                flat = torch.zeros(self.numels[i], dtype=dtype, device=self.device)
            rows.append(self.padded_rows(flat.reshape(-1), i))
        if out is None:
            return torch.cat(rows, dim=1).view(-1)
        torch.cat(rows, dim=1, out=out.view(self.world_size, self.block))
        return out

    def own_block_input(
        self, pieces: Sequence[torch.Tensor], gathered: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's block for an all-gather: its pieces (cast to the layout's dtype), each
        followed by its padding, whose values nothing reads. With `gathered` (the all-gather's
        output), written in place into this rank's block of it: no copy at the gather."""
        if gathered is not None:
            block = gathered[self.rank * self.block : (self.rank + 1) * self.block]
        else:
            block = torch.empty(self.block, dtype=self.dtype, device=self.device)
        dst = [block[o : o + p.numel()] for o, p in zip(self.offsets, pieces) if p.numel()]
        src = [p.reshape(-1) for p in pieces if p.numel()]
        if dst:
            torch._foreach_copy_(dst, src)
        return block

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
