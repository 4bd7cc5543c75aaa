"""The two faces of a fully_shard parameter: the piece a rank keeps, the whole it computes with.

Between forwards a unit's module holds `ShardParameter`s: this rank's piece
of each parameter (flattened, 1-D, phalanx.optim.sharding's split), which
the optimizer steps like any parameter, so its state is 1/N by itself.
During the unit's forward and backward the module holds the *full*
parameters instead: leaves that autograd accumulates into, whose storage
lives in one flat buffer per unit that is freed (resized to nothing) when
the unit is not computing and refilled by an all-gather when it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.optim.sharding import Piece


class ShardUseError(PhalanxError):
    """A sharded parameter was used in a computation outside its unit's forward."""


class ShardParameter(nn.Parameter):
    """This rank's piece of a fully_shard parameter: what the optimizer (and a checkpoint) sees.

    Using it in a gradient-tracked computation is always a mistake (the
    computation wanted the whole parameter, which exists only inside the
    unit's forward), so that raises at once, naming the parameter.
    """

    full_shape: torch.Size
    """The parameter's real shape, e.g. for choosing weight decay by dimension."""
    piece: Piece
    """Which elements of the flattened parameter this rank holds."""
    qualified_name: str

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> ShardParameter:
        return super().__new__(cls, data, requires_grad)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            out = nn.Parameter.__torch_function__(func, types, args, kwargs or {})
        except Exception as exc:  # a shape error, most likely: the op wanted the whole tensor
            if torch.is_grad_enabled():
                raise _misuse(args) from exc
            raise
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            raise _misuse(args)
        return out


def _misuse(args: Any) -> ShardUseError:
    shard = next((a for a in _flat(args) if isinstance(a, ShardParameter)), None)
    return ShardUseError(
        f"parameter '{getattr(shard, 'qualified_name', '?')}' of a fully_shard unit was used "
        "in a computation outside that unit's forward, where only this rank's piece exists "
        "— use it only inside the unit's forward, or fully_shard a module that contains "
        "every module using it (tied weights belong in one unit)"
    )


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, list | tuple):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def make_shard(full: torch.Tensor, piece: Piece, qualified_name: str) -> ShardParameter:
    """This rank's piece of `full` as a ShardParameter (a copy: `full` is about to be freed)."""
    data = full.detach().reshape(-1)[piece.start : piece.stop].clone()
    shard = ShardParameter(data, requires_grad=full.requires_grad)
    shard.full_shape = full.shape
    shard.piece = piece
    shard.qualified_name = qualified_name
    return shard


def full_shape_of(param: torch.Tensor) -> torch.Size:
    """A parameter's real shape, whether it is whole or a fully_shard piece."""
    return getattr(param, "full_shape", param.shape)
