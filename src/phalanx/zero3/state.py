"""A fully_shard model's (and its optimizer's) state: whole on one rank, or sharded for DCP.

Between steps a fully_shard model holds only pieces, so `model.state_dict()`
holds pieces too (1-D, this rank's). These functions give the two forms
users need: the whole state on one rank (the plain model's keys and shapes,
what `phalanx consolidate` writes and any plain model loads), and the
sharded form for torch.distributed.checkpoint, every piece a 1-D DTensor
of the flattened parameter, which DCP saves from every rank and reshards.
The optimizer over the pieces is a plain optimizer; its state goes through
the same piece machinery as ZeRO stages 1 and 2 (phalanx.optim.zero_state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from phalanx.errors import ConfigurationError
from phalanx.optim import zero_checkpoint, zero_state
from phalanx.optim.sharding import ShardedFlat, all_gather_flat
from phalanx.zero3.params import ShardParameter

# torch.distributed.checkpoint and DTensor are imported where they are used: together
# they cost seconds of CPU at import, in every process, sharded or not.


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    chosen = group if group is not None else dist.group.WORLD
    assert chosen is not None
    return chosen


def shard_keys(model: nn.Module) -> dict[str, ShardParameter]:
    """Every state_dict key that holds a piece (a tied parameter under each of its names)."""
    found: dict[str, ShardParameter] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if isinstance(p, ShardParameter):
                found[f"{name}.{pname}" if name else pname] = p
    return found


def full_state_dict(
    model: nn.Module, to: int = 0, group: dist.ProcessGroup | None = None
) -> dict[str, Any] | None:
    """Collective: the plain model's state_dict (whole tensors) on rank `to`, None elsewhere."""
    group = _group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    state = model.state_dict()
    keys = shard_keys(model)
    unique: dict[int, ShardParameter] = {id(p): p for p in keys.values()}
    by_dtype: dict[torch.dtype, list[ShardParameter]] = {}
    for p in unique.values():
        by_dtype.setdefault(p.dtype, []).append(p)
    whole: dict[int, torch.Tensor] = {}
    for dtype, shards in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        layout = ShardedFlat([p.piece.numel for p in shards], world, rank, dtype, shards[0].device)
        block = layout.own_block_input([p.detach() for p in shards])
        out = block.new_empty(world * layout.block)
        all_gather_flat(out, block, group, async_op=False)
        if rank == to:
            targets = [block.new_empty(p.full_shape) for p in shards]
            layout.copy_out(out, targets)
            whole.update((id(p), t) for p, t in zip(shards, targets))
    if rank != to:
        return None
    for key, p in keys.items():
        state[key] = whole[id(p)]
    return state


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load the plain model's state_dict (whole tensors): each rank keeps its pieces."""
    local = dict(state_dict)
    for key, p in shard_keys(model).items():
        if key not in local:
            continue
        value = local[key]
        if tuple(value.shape) != tuple(p.full_shape):
            raise ConfigurationError(
                f"{key} has shape {list(value.shape)} in the state dict but "
                f"{list(p.full_shape)} in the model — load a state of the same model"
            )
        local[key] = value.reshape(-1)[p.piece.start : p.piece.stop]
    model.load_state_dict(local)


def sharded_state_dict(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The model's state with every piece as a 1-D DTensor sharing the piece's storage."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    group = _group(group)
    state = model.state_dict()
    keys = shard_keys(model)
    if keys:
        device = next(iter(keys.values())).device
        mesh = DeviceMesh.from_group(group, device.type)
        for key, p in keys.items():
            state[key] = DTensor.from_local(
                p.detach(),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size([p.piece.numel]),
                stride=(1,),
            )
    return state


def save_model_sharded(model: nn.Module, directory: Path) -> None:
    """Collective: every rank writes its pieces (and rank 0 the replicated rest) with DCP."""
    import torch.distributed.checkpoint as dcp

    shapes = {key: list(p.full_shape) for key, p in shard_keys(model).items()}
    dcp.save({"model": sharded_state_dict(model), "shapes": shapes}, checkpoint_id=str(directory))


def load_model_sharded(model: nn.Module, directory: Path) -> None:
    """Collective: read this rank's pieces in place, whatever world size wrote them."""
    from phalanx import safe_dcp

    state = sharded_state_dict(model)
    safe_dcp.load({"model": state}, directory)


def optimizer_pieces(
    optim: Optimizer, group: dist.ProcessGroup | None = None
) -> zero_state.PieceOptimizer:
    """A plain optimizer over a fully_shard model's pieces, seen as pieces of whole tensors."""
    params = [p for g in optim.param_groups for p in g["params"]]
    bare = [i for i, p in enumerate(params) if not isinstance(p, ShardParameter)]
    if bare:
        raise ConfigurationError(
            f"optimizer parameter {bare[0]} is not a fully_shard piece — build the optimizer "
            "after fully_shard, over model.parameters()"
        )
    return zero_state.PieceOptimizer(
        optim=optim,
        shapes=[p.full_shape for p in params],
        pieces=[p.piece for p in params],
        group=_group(group),
        groups=optim.param_groups,
        device=params[0].device if params else torch.device("cpu"),
    )


def full_optimizer_state_dict(optim: Optimizer, to: int = 0) -> dict[str, Any] | None:
    """Collective: the plain optimizer's state_dict (whole tensors) on rank `to`."""
    return zero_state.consolidate(optimizer_pieces(optim), to)


def load_full_optimizer_state_dict(optim: Optimizer, state_dict: dict[str, Any]) -> None:
    zero_state.load_plain(optimizer_pieces(optim), state_dict)


def save_optimizer_sharded(optim: Optimizer, directory: Path) -> None:
    zero_checkpoint.save_sharded(optimizer_pieces(optim), directory)


def load_optimizer_sharded(optim: Optimizer, directory: Path) -> None:
    zero_checkpoint.load_sharded(optimizer_pieces(optim), directory)
