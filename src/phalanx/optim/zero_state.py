"""ZeRO state in and out: the plain optimizer format, the sharded DCP form, and the norm.

The plain format is `torch.optim.Optimizer.state_dict()`'s: state per
parameter index, whole tensors shaped like the parameter. A file in that
format moves a run between ZeRO and plain DDP, or between world sizes.
The sharded form is the same structure with each piece-wise state tensor
as a 1-D DTensor (`Shard(0)` of the flattened parameter, the split of
phalanx.optim.sharding), which torch.distributed.checkpoint writes from
every rank at once and reads back at any world size.

Which state is piece-wise: any tensor of the parameter's shape in the plain
format, and any 1-D tensor as long as the rank's piece locally. "step" and
0-dim tensors are per-parameter scalars, the same on every rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.optim.sharding import Piece, ShardedFlat, all_gather_flat

if TYPE_CHECKING:
    from phalanx.optim.zero import ZeroRedundancyOptimizer

SCALAR_KEYS = ("step",)


def is_piecewise(key: str, value: Any, piece: Piece) -> bool:
    """Whether a local state value holds this rank's piece of a per-element quantity."""
    return (
        key not in SCALAR_KEYS
        and isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == piece.length
    )


def plain_groups(zero: ZeroRedundancyOptimizer) -> list[dict[str, Any]]:
    index = {id(p): i for i, p in enumerate(zero._params)}
    groups = []
    for group in zero.param_groups:
        plain = {k: v for k, v in group.items() if k != "params"}
        plain["params"] = [index[id(p)] for p in group["params"]]
        groups.append(plain)
    return groups


def consolidate(zero: ZeroRedundancyOptimizer, to: int) -> dict[str, Any] | None:
    """Collective: the whole state in the plain format on rank `to` (None elsewhere)."""
    local_state = zero.optim.state_dict()["state"]
    full: dict[int, dict[str, Any]] = {}
    piecewise: dict[tuple[str, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, state in sorted(local_state.items()):
        full[i] = {}
        for key, value in state.items():
            if is_piecewise(key, value, zero._pieces[i]):
                piecewise[(key, value.dtype, value.device)].append(i)
            else:
                full[i][key] = value.clone() if isinstance(value, torch.Tensor) else value
    # Every rank walks the same keys in the same order: the state's structure is replicated.
    for (key, _, _), members in sorted(piecewise.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        params = [zero._params[i] for i in members]
        layout = ShardedFlat(params, zero.world_size, zero.rank)
        block = layout.own_block_input([local_state[i][key] for i in members])
        out = torch.empty(zero.world_size * layout.block, dtype=block.dtype, device=block.device)
        all_gather_flat(out, block, zero.process_group, async_op=False)
        if zero.rank == to:
            targets = [torch.empty(p.shape, dtype=block.dtype, device=block.device) for p in params]
            layout.copy_out(out, targets)
            for i, target in zip(members, targets):
                full[i][key] = target
    if zero.rank != to:
        return None
    return {"state": full, "param_groups": plain_groups(zero)}


def load_plain(zero: ZeroRedundancyOptimizer, state_dict: dict[str, Any]) -> None:
    """Keep this rank's piece of every whole tensor, then load the local optimizer."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(zero.param_groups):
        count = len(groups) if isinstance(groups, list) else "no"
        raise ConfigurationError(
            f"the optimizer state has {count} parameter groups but this optimizer has "
            f"{len(zero.param_groups)} — load a state saved from the same model and groups"
        )
    local: dict[int, dict[str, Any]] = {}
    for raw_index, state in state_dict.get("state", {}).items():
        i = int(raw_index)
        shape, piece = zero._params[i].shape, zero._pieces[i]
        local[i] = {
            key: _piece(value, piece) if _is_whole(key, value, shape) else value
            for key, value in state.items()
        }
    zero.optim.load_state_dict({"state": local, "param_groups": groups})
    for mine, saved in zip(zero.param_groups, groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})


def _is_whole(key: str, value: Any, shape: torch.Size) -> bool:
    return key not in SCALAR_KEYS and isinstance(value, torch.Tensor) and value.shape == shape


def _piece(value: torch.Tensor, piece: Piece) -> torch.Tensor:
    return value.reshape(-1)[piece.start : piece.stop].clone()


def clip_pieces(
    shards: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """`clip_grad_norm_` over every rank's pieces: partial norms summed (or maxed) across ranks."""
    grads = [s.grad for s in shards if s.grad is not None]
    device = grads[0].device if grads else shards[0].device
    if math.isinf(norm_type):
        local = max((g.abs().max() for g in grads if g.numel()), default=torch.zeros(()))
        total = local.to(device=device, dtype=torch.float32).reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        powers = [torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]
        total = torch.stack(powers).sum().reshape(1) if powers else torch.zeros(1, device=device)
        dist.all_reduce(total, group=group)
        total = total ** (1.0 / norm_type)
    norm = total[0]
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return norm
