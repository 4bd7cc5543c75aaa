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
from collections.abc import Callable, Sequence
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


Wanted = Callable[[torch.Size], tuple[int, int]]
"""The element range of a tensor of this shape that a rank keeps (its new rows)."""


def whole(shape: torch.Size) -> tuple[int, int]:
    """Keep all of it."""
    return 0, math.prod(shape)


class Assembly:
    """Tensors put together from every old rank's pieces, fed in rank order one rank's
    bundle at a time (`add`), keeping of each only the range `wanted` asks for: a rank that
    needs its new rows never holds the whole state, nor more than one bundle besides them
    (live recovery's peak). Pieces are contiguous and in rank order (`own_pieces`, or stage
    3's rows); the per-parameter scalars ("step") are the same on every rank."""

    def __init__(self, shapes: Sequence[torch.Size], wanted: Wanted = whole) -> None:
        self.shapes = list(shapes)
        self.wanted = wanted
        self._seen: dict[str, int] = {}
        """Elements of each tensor fed so far: where the next rank's piece starts."""
        self._kept: dict[str, list[torch.Tensor]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._scalars: dict[str, torch.Tensor] = {}

    def shape_of(self, name: str) -> torch.Size:
        """The whole shape of piece `name` ("p3", "s3.exp_avg": parameter 3's)."""
        return self.shapes[_index_of(name)]

    @property
    def rows_only(self) -> bool:
        """Whether this keeps a part of each tensor (else every tensor whole)."""
        return self.wanted is not whole

    def add(self, bundle: dict[str, torch.Tensor], starts: dict[str, int] | None = None) -> None:
        """The next old rank's pieces, taken out of `bundle` as they are kept. `starts`:
        where each piece (or part of one) begins in its tensor, when not right after the
        last one added (parts sent to this rank alone, `zero3` rows of a known layout)."""
        for name in list(bundle):
            value = bundle.pop(name)
            key = name.split(".", 1)[1] if "." in name else None
            if key in SCALAR_KEYS or value.dim() == 0:
                self._scalars.setdefault(name, value)
                continue
            shape = self.shapes[_index_of(name)]
            self._dtypes.setdefault(name, value.dtype)
            start = self._seen.get(name, 0) if starts is None else starts[name]
            stop = start + value.numel()
            self._seen[name] = stop
            lo, hi = self.wanted(shape)
            lo, hi = max(lo, start), min(hi, stop)
            if lo >= hi:
                continue
            flat = value.reshape(-1)
            whole_piece = lo == start and hi == stop
            self._kept.setdefault(name, []).append(
                flat if whole_piece else flat[lo - start : hi - start].clone()
            )

    def finish(self) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """The parameters' wanted ranges, and the optimizer state's in the plain format,
        each shaped as rows of its tensor (the whole tensor when wanted whole)."""
        params = [self._rows(f"p{i}", shape) for i, shape in enumerate(self.shapes)]
        state: dict[int, dict[str, torch.Tensor]] = {}
        names = {*self._dtypes, *self._scalars} - {f"p{i}" for i in range(len(params))}
        for name in sorted(names, key=lambda n: (_index_of(n), n)):
            i, key = _index_of(name), name.split(".", 1)[1]
            scalar = self._scalars.get(name)
            value = scalar if scalar is not None else self._rows(name, self.shapes[i])
            state.setdefault(i, {})[key] = value
        return params, state

    def _rows(self, name: str, shape: torch.Size) -> torch.Tensor:
        lo, hi = self.wanted(shape)
        parts = self._kept.pop(name, [])
        if not parts:  # no rows here (more ranks than rows), or a tensor never sent
            flat = torch.empty(0, dtype=self._dtypes.get(name, torch.float32))
        else:
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        assert flat.numel() == hi - lo, f"{name}: pieces cover {flat.numel()} of {hi - lo}"
        if (lo, hi) == whole(shape):
            return flat.reshape(shape)
        row = math.prod(shape[1:]) or 1
        return flat.reshape((hi - lo) // row, *shape[1:])


def whole_from_pieces(
    shapes: Sequence[torch.Size], bundles: Sequence[dict[str, torch.Tensor]]
) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Every rank's pieces, in rank order, back into whole tensors: the parameters, and the
    optimizer state in the plain format (an `Assembly` that wants everything)."""
    assembly = Assembly(shapes)
    for bundle in bundles:
        assembly.add(bundle)
    return assembly.finish()


def _index_of(name: str) -> int:
    """3 for "p3" and "s3.exp_avg"."""
    return int(name.split(".", 1)[0][1:])
