"""Which ranks a fully_shard unit shards over, which it replicates over, and its device.

A 1-D `DeviceMesh` shards every parameter across all its ranks (FSDP,
placement `(Shard(0),)`). A 2-D mesh `(replicate, shard)` is HSDP: each
parameter is sharded across the ranks of one row (one host, typically) and
replicated across the rows, placement `(Replicate(), Shard(0))`; gathers and
reduce-scatters stay inside a row, and only the reduced gradient shards cross
rows, in one all-reduce per unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.runtime.live import current_live_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

_POST_FORWARD_GROUPS = "_phalanx_post_forward_groups"
"""The attribute of a DeviceMesh that holds the groups its units reshard to after forward:
the mesh owns them, so they go with it (a cache keyed by id(mesh) outlived its mesh)."""


@dataclass(frozen=True)
class MeshInfo:
    """A unit's mesh, seen as the groups its collectives run in."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    """HSDP's all-reduce group across the rows; None on a 1-D mesh."""
    replicate_size: int
    placements: tuple[Placement, ...]
    device: torch.device
    row_ranks: list[list[int]] = field(repr=False)
    """Global ranks of every row of the mesh (one row on a 1-D mesh), in shard order."""

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients a step averages: every rank of the mesh."""
        return self.shard_size * self.replicate_size


def unit_group(info: MeshInfo) -> dist.ProcessGroup:
    """Every rank of a unit's mesh as one group (the world's, for a 2-D mesh)."""
    group = info.mesh.get_group(0) if info.mesh.ndim == 1 else dist.group.WORLD
    assert group is not None
    return group


def default_mesh() -> DeviceMesh:
    """Every rank of the default group, on this rank's device (cuda under NCCL, else cpu).

    Made on each call, as torch's `fully_shard(mesh=None)` does: over the whole world it
    wraps the default group itself, so it costs no collective, and it always reads the
    group as it is now (after a live re-form: another size, or this process at another
    rank). Meshes compare by value, so units given one each still agree.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=_names())


def _names() -> tuple[str, ...] | None:
    """None, but under live recovery the generation's own name: two meshes over the same ranks
    are equal to torch whatever this process's coordinate in each, and DTensor's dispatch
    caches output specs by their meshes, so after a re-form (this process at another rank) a
    cached spec would hand new shards the old mesh and its old coordinate."""
    group = current_live_group()
    return None if group is None else (f"dp_g{group.generation}",)


def mesh_info(mesh: DeviceMesh | None) -> MeshInfo:
    """Check `mesh` (1-D FSDP or 2-D HSDP) and describe it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = default_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(
            f"mesh={mesh!r} is not a DeviceMesh — build one with "
            "torch.distributed.device_mesh.init_device_mesh(...), or leave mesh out"
        )
    if mesh.ndim not in (1, 2):
        raise ConfigurationError(
            f"mesh has {mesh.ndim} dimensions: fully_shard takes a 1-D mesh (FSDP) or a 2-D "
            "(replicate, shard) mesh (HSDP) — slice the data-parallel dimensions out of it"
        )
    if mesh.get_coordinate() is None:
        raise ConfigurationError(
            f"rank {dist.get_rank()} is not in the mesh {mesh} — call fully_shard with a mesh "
            "that contains every rank that runs it"
        )
    shard_group = mesh.get_group(mesh.ndim - 1)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
    placements: tuple[Placement, ...] = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    shard_size = dist.get_world_size(shard_group)
    return MeshInfo(
        mesh=mesh,
        shard_group=shard_group,
        shard_size=shard_size,
        shard_rank=dist.get_rank(shard_group),
        replicate_group=replicate_group,
        replicate_size=dist.get_world_size(replicate_group) if replicate_group else 1,
        placements=placements,
        device=device,
        row_ranks=mesh.mesh.reshape(-1, shard_size).tolist(),
    )


def post_forward_group(info: MeshInfo, size: int) -> dist.ProcessGroup:
    """The group of `size` consecutive shard ranks this rank reshards to after forward
    (`reshard_after_forward=size`); every rank creates every such group, once per mesh."""
    groups: dict[int, dist.ProcessGroup] = info.mesh.__dict__.setdefault(_POST_FORWARD_GROUPS, {})
    if size not in groups:
        chunks = [row[i : i + size] for row in info.row_ranks for i in range(0, len(row), size)]
        mine, _ = dist.new_subgroups_by_enumeration(chunks)
        assert mine is not None  # every rank is in one chunk
        groups[size] = mine
    return groups[size]


def check_reshard_size(value: bool | int | None, info: MeshInfo) -> bool | int | None:
    """FSDP2's reshard_after_forward: None, a bool, or a divisor of the shard size (1 is
    False, the shard size is True); anything else is refused."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ConfigurationError(
            f"reshard_after_forward={value!r} — pass True, False, or an int: the group size "
            "to reshard to after forward"
        )
    size = info.shard_size
    if value < 1 or value > size or size % value:
        raise ConfigurationError(
            f"reshard_after_forward={value} does not divide the {size} ranks parameters are "
            f"sharded over — pass a divisor of {size} (e.g. the GPUs per host), True or False"
        )
    if value == 1:
        return False
    return True if value == size else value
