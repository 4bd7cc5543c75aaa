"""DCP's format, written by every rank alone: no collective for the data, one to agree.

torch's `dcp.save` plans in three collectives before a byte is written (every
rank's plan gathered on the coordinator, deduplicated, the final plans
scattered back) and gathers every rank's results after, to write `.metadata`.
On a large job that coordination is most of a save (tnt#1064: 50 of 67 minutes).
It is not needed here: the layout of a sharded state is decided by its
DTensors' placements and mesh, the same on every rank, so every rank computes
the whole plan by itself — which rank writes which chunk (every chunk once: a
DTensor's chunk by the rank at coordinate 0 of the dimensions it is replicated
on, a plain tensor or value by rank 0, as DCP's save_to_lowest_rank dedup does),
and every chunk's place in the global tensor (torch's own
`_compute_local_shape_and_global_offset` for each mesh coordinate). Each rank
writes its chunks into `__<rank>_0.distcp`, each item as DCP writes it
(torch.save of the tensor, or the planner's bytes), and records their lengths.

The one collective left is the agreement a save needs anyway, that every rank
wrote its part: an all-gather of each rank's failure or item lengths (the
lengths place each item in its file; the plan says which item each length is).
Rank 0 then builds `Metadata` from its own plan and those lengths (chunks in
mesh order, storage, the flattening mappings) and writes `.metadata`; the
lengths are checked against the plan's count of each rank's items. torch's
`dcp.load` and FSDP2 scripts read the result as any DCP checkpoint
(tests/distributed/test_dcp_local.py). writes.py runs this for a background
save; `save` below is the same for one state, on its own.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phalanx.ground.safe_files import open_new
from phalanx.offload.held import SaveHold
from phalanx.runtime import World

METADATA = ".metadata"


@dataclass(frozen=True)
class Item:
    """One item of the global plan: which rank writes it, and where it lies."""

    fqn: str
    offsets: tuple[int, ...]
    """The chunk's offset in the whole tensor (() for a value)."""
    sizes: tuple[int, ...] | None
    """The chunk's size (None for a value written as bytes)."""
    writer: int


class LocalPlan:
    """The whole plan of one state, computed by this rank alone (module docstring)."""

    def __init__(self, state: dict[str, Any], rank: int) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        self.rank = rank
        self.planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        self.planner.set_up_planner(state, None, rank == 0)
        self.local = self.planner.create_local_plan()
        self.items: list[Item] = []
        self.mine: list[Any] = []
        """This rank's WriteItems, in the order it writes them."""
        for write in self.local.items:
            self._place(write)

    def _place(self, write: Any) -> None:
        from torch.distributed.checkpoint.planner import WriteItemType

        if write.type != WriteItemType.SHARD:
            sizes = None if write.tensor_data is None else tuple(write.tensor_data.size)
            offsets = tuple(0 for _ in sizes or ())
            self.items.append(Item(write.index.fqn, offsets, sizes, 0))
            if self.rank == 0:
                self.mine.append(write)
            return
        tensor = self.planner.state_dict[write.index.fqn]
        chunks = dtensor_chunks(tensor)
        self.items += [Item(write.index.fqn, o, s, r) for r, o, s in chunks]
        if any(r == self.rank for r, _, _ in chunks):
            self.mine.append(write)

    def written_by(self, rank: int) -> list[Item]:
        return [item for item in self.items if item.writer == rank]


def dtensor_chunks(tensor: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(writer rank, offsets, sizes) of every distinct chunk of a DTensor, in mesh order: the
    chunk of each mesh coordinate that is 0 on every dimension it is replicated on."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements
    ranks = mesh.mesh
    chunks = []
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        if any(c and isinstance(p, Replicate) for c, p in zip(coordinate, placements)):
            continue
        sizes, offsets = _compute_local_shape_and_global_offset(
            tensor.shape, tuple(mesh.shape), list(coordinate), placements
        )
        chunks.append((int(ranks[coordinate].item()), tuple(offsets), tuple(sizes)))
    return chunks


def write_part(plan: LocalPlan, directory: Path, hold: SaveHold | None = None) -> list[int]:
    """Write this rank's items into `directory/__<rank>_0.distcp` (fsynced); their lengths.
    `hold`: the tensors it keeps still are written from it (offload/held.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = []
    path = directory / data_file(plan.rank)
    with open_new(path) as stream:
        for write in plan.mine:
            start = stream.tell()
            data = plan.planner.resolve_data(write)
            if isinstance(data, io.BytesIO):  # a value: the planner's torch.save of it
                stream.write(data.getbuffer())
            else:
                with _still(hold, data.detach()) as tensor:
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()  # a view: torch.save would write all its storage
                    torch.save(tensor.cpu(), stream)
            lengths.append(stream.tell() - start)
        stream.flush()
        os.fsync(stream.fileno())
    return lengths


def _still(hold: SaveHold | None, tensor: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
    return nullcontext(tensor) if hold is None else hold.reading(tensor)


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def metadata(plan: LocalPlan, lengths: list[list[int]]) -> Any:
    """The checkpoint's DCP Metadata, from the plan and every rank's item lengths."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    properties = {w.index.fqn: w.tensor_data for w in plan.local.items if w.tensor_data}
    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for rank, rank_lengths in enumerate(lengths):
        items = plan.written_by(rank)
        if len(items) != len(rank_lengths):
            raise ValueError(
                f"rank {rank} wrote {len(rank_lengths)} items and the plan has {len(items)}"
            )
        position = 0
        for item, length in zip(items, rank_lengths):
            if item.sizes is None:
                md[item.fqn] = BytesStorageMetadata()
                index = MetadataIndex(item.fqn)
            else:
                data = properties[item.fqn]
                entry = md.setdefault(
                    item.fqn, TensorStorageMetadata(data.properties, data.size, [])
                )
                chunk = ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes))
                index = MetadataIndex(item.fqn, torch.Size(item.offsets), len(entry.chunks))
                entry.chunks.append(chunk)
            storage[index] = _StorageInfo(data_file(rank), position, length)
            position += length
    result = Metadata(md, planner_data=plan.planner.mappings, storage_data=storage)
    result.storage_meta = StorageMeta()
    return result


def write_metadata(meta: Any, directory: Path) -> None:
    with open_new(directory / METADATA) as stream:
        pickle.dump(meta, stream)
        stream.flush()
        os.fsync(stream.fileno())


def save(state: dict[str, Any], directory: Path, world: World) -> None:
    """Write `state` (DTensors and plain values) as a DCP checkpoint in `directory`, every
    rank its own part; one all-gather over `world` agrees that all did, and a failure on
    any rank is raised on every rank (this rank's own, or a CheckpointError naming it)."""
    from phalanx.errors import CheckpointError

    mine: Exception | None = None
    lengths: list[int] = []
    try:
        plan = LocalPlan(state, world.rank)
        lengths = write_part(plan, directory)
    except Exception as exc:  # raised below, once every rank knows
        mine = exc
    said = None if mine is None else f"{type(mine).__name__}: {mine}"
    agreed = world.all_gather_json({"failure": said, "lengths": lengths})
    failed = [(r, a["failure"]) for r, a in enumerate(agreed) if a["failure"] is not None]
    if mine is not None:
        raise mine
    if failed:
        rank, why = failed[0]
        raise CheckpointError(f"rank {rank} could not write its part of {directory}: {why}")
    if world.is_main:
        write_metadata(metadata(plan, [a["lengths"] for a in agreed]), directory)
