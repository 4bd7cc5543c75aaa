"""HSDP's mesh for a run that names its shard group's size (the Trainer's zero3_shard_size):
rows of that many ranks, one host's where the hosts allow, each row holding the whole
model sharded over its ranks and the rows replicating each other.

Every shard then lives on every row, so live recovery takes a lost rank's shard
from a replica instead of a snapshot (train/live_sharded.py). After a loss the
world may not divide into rows any more (3 ranks left of a 2 x 2 mesh): it is
then sharded over every rank (a 1-D mesh) until a replacement makes it whole.
Under live recovery the rows and columns are gloo groups of the generation
(runtime/live_side.py), whose waits end when a member is lost.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from phalanx.runtime.live import current_live_group
from phalanx.runtime.live_side import SideGroup
from phalanx.runtime.membership import settings_from_env
from phalanx.runtime.wire import all_gather_json

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["hybrid_layout", "hybrid_mesh"]


def hybrid_layout(nodes: list[int], shard_size: int) -> list[list[int]] | None:
    """Rows of `shard_size` global ranks, given each rank's node: the ranks ordered by node
    (then rank) and cut in rows, so a host's ranks share rows where their count allows;
    None when they do not make two rows or more of that size (then: shard over all)."""
    world = len(nodes)
    if shard_size < 1 or world % shard_size or world // shard_size < 2:
        return None
    order = sorted(range(world), key=lambda rank: (nodes[rank], rank))
    return [order[start : start + shard_size] for start in range(0, world, shard_size)]


def hybrid_mesh(shard_size: int, node_rank: int, device_type: str) -> DeviceMesh | None:
    """The `(replicate, shard)` mesh of `hybrid_layout` over the default group's ranks, or
    None where the world does not divide into rows (collective: every rank says its node)."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = hybrid_layout([int(n) for n in all_gather_json(node_rank)], shard_size)
    if layout is None:
        return None
    live = current_live_group()
    if live is None:
        return DeviceMesh(device_type, torch.tensor(layout), mesh_dim_names=("replicate", "shard"))
    me = live.rank()
    row = next(i for i, ranks in enumerate(layout) if me in ranks)
    column = layout[row].index(me)
    connect = timedelta(seconds=settings_from_env().settle_s)
    gen = live.generation
    replicas = SideGroup(live, f"hsdp_col{column}", [r[column] for r in layout], connect)
    shards = SideGroup(live, f"hsdp_row{row}", layout[row], connect)
    return DeviceMesh.from_group(  # names of the generation: see zero3/mesh.py's _names
        [replicas, shards],
        device_type,
        mesh=torch.tensor(layout),
        mesh_dim_names=(f"replicate_g{gen}", f"shard_g{gen}"),
    )
