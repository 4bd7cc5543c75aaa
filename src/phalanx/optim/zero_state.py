"""Optimizer state of pieces, in and out: the plain format, the sharded DCP form, and the norm.

Every ZeRO stage ends with an optimizer that steps pieces (this rank's part
of each parameter, phalanx.parallel.sharding): stages 1 and 2 through
`ZeroRedundancyOptimizer.optim`, stage 3 through a plain optimizer over a
fully_shard model's `ShardParameter`s. `PieceOptimizer` describes either, and
the functions here serve both.

The plain format is `torch.optim.Optimizer.state_dict()`'s: state per
parameter index, whole tensors shaped like the parameter. A file in that
format moves a run between ZeRO and plain DDP, or between world sizes.
Which state is piece-wise: any tensor of the parameter's shape in the plain
format, and any 1-D tensor as long as the rank's piece locally. "step" and
0-dim tensors are per-parameter scalars, the same on every rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from phalanx.errors import ConfigurationError
from phalanx.parallel.collectives import all_gather
from phalanx.parallel.sharding import Piece, ShardedFlat

SCALAR_KEYS = ("step",)


@dataclass(frozen=True)
class PieceOptimizer:
    """An optimizer whose parameter i is this rank's `pieces[i]` of a tensor of `shapes[i]`."""

    optim: Optimizer
    shapes: list[torch.Size]
    pieces: list[Piece]
    group: dist.ProcessGroup
    groups: list[dict[str, Any]]
    """The authoritative hyperparameters per group (a scheduler edits these)."""
    device: torch.device

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def plain_groups(self) -> list[dict[str, Any]]:
        """`param_groups` as the plain optimizer writes them: hyperparameters, then indices."""
        out, index = [], 0
        for mine, local in zip(self.groups, self.optim.param_groups):
            plain = {k: v for k, v in mine.items() if k != "params"}
            plain["params"] = list(range(index, index + len(local["params"])))
            index += len(local["params"])
            out.append(plain)
        return out


def is_piecewise(key: str, value: Any, piece: Piece) -> bool:
    """Whether a local state value holds this rank's piece of a per-element quantity."""
    return (
        key not in SCALAR_KEYS
        and isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == piece.length
    )


def consolidate(view: PieceOptimizer, to: int) -> dict[str, Any] | None:
    """Collective: the whole state in the plain format on rank `to` (None elsewhere)."""
    local_state = view.optim.state_dict()["state"]
    full: dict[int, dict[str, Any]] = {}
    piecewise: dict[tuple[str, torch.dtype], list[int]] = defaultdict(list)
    for i, state in sorted(local_state.items()):
        full[i] = {}
        for key, value in state.items():
            if is_piecewise(key, value, view.pieces[i]):
                piecewise[(key, value.dtype)].append(i)
            else:
                full[i][key] = value.clone() if isinstance(value, torch.Tensor) else value
    # Every rank walks the same keys in the same order: the state's structure is replicated.
    for (key, dtype), members in sorted(
        piecewise.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))
    ):
        numels = [view.pieces[i].numel for i in members]
        layout = ShardedFlat(numels, view.world_size, view.rank, dtype, view.device)
        block = layout.own_block_input([local_state[i][key] for i in members])
        out = block.new_empty(view.world_size * layout.block)
        all_gather(out, block, view.group)
        if view.rank == to:
            targets = [block.new_empty(view.shapes[i]) for i in members]
            layout.copy_out(out, targets)
            for i, target in zip(members, targets):
                full[i][key] = target
    if view.rank != to:
        return None
    return {"state": full, "param_groups": view.plain_groups()}


def load_plain(view: PieceOptimizer, state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep this rank's piece of every whole tensor, load the local optimizer; return the groups."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(view.optim.param_groups):
        count = len(groups) if isinstance(groups, list) else "no"
        raise ConfigurationError(
            f"the optimizer state has {count} parameter groups but this optimizer has "
            f"{len(view.optim.param_groups)} — load a state saved from the same model and groups"
        )
    local: dict[int, dict[str, Any]] = {}
    for raw_index, state in state_dict.get("state", {}).items():
        i = int(raw_index)
        shape, piece = view.shapes[i], view.pieces[i]
        local[i] = {
            key: _piece(value, piece) if _is_whole(key, value, shape) else value
            for key, value in state.items()
        }
    view.optim.load_state_dict({"state": local, "param_groups": groups})
    return groups


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
    with torch.no_grad():
        if math.isinf(norm_type):
            local = max((g.abs().max() for g in grads if g.numel()), default=torch.zeros(()))
            total = local.to(device=device, dtype=torch.float32).reshape(1)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            powers = [torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]
            total = (
                torch.stack(powers).sum().reshape(1) if powers else torch.zeros(1, device=device)
            )
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / norm_type)
        norm = total[0]
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return norm


def own_pieces(
    view: PieceOptimizer, params: Sequence[torch.Tensor], copy: bool = True
) -> dict[str, torch.Tensor]:
    """This rank's pieces, copied (`copy=False`: views of the live ones, for a caller that
    copies them itself): of each parameter ("p<i>") and of each piece-wise state value
    ("s<i>.<key>"), with the per-parameter scalars ("s<i>.step"). The state of the run
    that only this rank holds, for a neighbour to keep (live recovery)."""
    state = view.optim.state_dict()["state"]
    out: dict[str, torch.Tensor] = {}
    for i, (p, piece) in enumerate(zip(params, view.pieces, strict=True)):
        out[f"p{i}"] = p.detach().reshape(-1)[piece.start : piece.stop].cpu()
        for key, value in state.get(i, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"s{i}.{key}"] = value.detach().cpu()
    return {name: t.clone() for name, t in out.items()} if copy else out


def whole_from_pieces(
    shapes: Sequence[torch.Size], bundles: Sequence[dict[str, torch.Tensor]]
) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Every rank's pieces (`own_pieces`, or stage 3's rows), in rank order, back into whole
    tensors: the parameters, and the optimizer state in the plain format (pieces are
    contiguous and in rank order). Takes the pieces out of `bundles` as it goes, so the
    whole state and its pieces are never both held (live recovery's peak)."""
    params: list[torch.Tensor] = []
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, shape in enumerate(shapes):
        params.append(torch.cat([b.pop(f"p{i}") for b in bundles]).reshape(shape))
        keys = sorted({name.split(".", 1)[1] for b in bundles for name in b if _of(name, i)})
        for key in keys:
            values = [b.pop(f"s{i}.{key}") for b in bundles if f"s{i}.{key}" in b]
            if key in SCALAR_KEYS or values[0].dim() == 0:
                whole = values[0]  # the same on every rank
            else:
                whole = torch.cat(values).reshape(shape)
            del values
            state.setdefault(i, {})[key] = whole
    return params, state


def _of(name: str, index: int) -> bool:
    return name.startswith(f"s{index}.")
