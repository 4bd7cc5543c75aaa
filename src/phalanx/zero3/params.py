"""One parameter of a fully_shard unit, and the words stage 3 uses.

[Glossary: shard, piece, unit]
- *Unit*: one `fully_shard(module)` call; its parameters are gathered together
  (one all-gather per unit and dtype) and reduced together.
- *Shard*: this rank's part of a parameter, dim-0 rows as `torch.chunk` cuts
  them (`phalanx.parallel.sharding.piece_of`). The *sharded parameter* is an
  `nn.Parameter` holding a DTensor with placement `Shard(0)` (FSDP) or
  `(Replicate(), Shard(0))` (HSDP) whose local tensor is the shard: what the
  optimizer steps, `model.state_dict()` holds and torch's tools (clip,
  DCP state dicts) read.
- *Piece*: the shard as a range of the flattened parameter's elements; on the
  wire each piece is padded to the same *chunk* on every rank.
- *Unsharded parameter*: the whole parameter, a plain `nn.Parameter` whose
  storage lives in the unit's flat buffer, gathered before the unit computes
  and freed after; what the module holds while it runs, and what autograd
  accumulates gradients into.

A module holds one face or the other (`register`); a unit knows its sharded
parameters by identity (zero3/wrap.py `is_sharded`); tied parameters (one
parameter registered in several places of a unit) are one `ShardedParam`
with several owners.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.parallel.sharding import Piece, piece_of, row_numel
from phalanx.zero3.home import Home
from phalanx.zero3.mesh import MeshInfo

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

Owners = tuple[tuple[nn.Module, str], ...]


class ShardUseError(PhalanxError, RuntimeError):
    """A sharded parameter was used in a computation outside its unit's forward."""


class ShardedParam:
    """A parameter's two faces and where it is registered (see the glossary above)."""

    def __init__(
        self, param: nn.Parameter, fqn: str, owners: Owners, info: MeshInfo, home: Home
    ) -> None:
        if param.dim() == 0:
            raise ConfigurationError(
                f"parameter '{fqn}' is a scalar: fully_shard shards parameters on dim 0, as "
                "FSDP2 does — give it shape (1,), or pass it in ignored_params"
            )
        self.owners = owners
        self.fqn = fqn
        """Its name in the model the root unit sees (relative to its unit until then)."""
        self.shape = param.shape
        self.info = info
        self.home = home
        self.grad_home: torch.Tensor | None = None
        """Offloaded: the gradient shard's buffer at home (made at the first reduction)."""
        self.piece: Piece = piece_of(
            param.numel(), info.shard_size, info.shard_rank, row_numel(param.shape)
        )
        rows = self.rows
        local = param.detach()[rows[0] : rows[1]]
        local = local.clone() if not local.is_meta else torch.empty_like(local)
        if local.device.type != "meta" and local.device != info.device and not home.away:
            local = local.to(info.device)
        local = home.keep(local.contiguous())
        self.spec = _spec(info, param.shape, param.dtype)
        self.sharded: nn.Parameter = nn.Parameter(
            _dtensor(local, self.spec), requires_grad=param.requires_grad
        )
        """The object the optimizer steps, known by its identity (`Unit.params` is what marks
        a parameter sharded: a `.to()` swaps its contents and its __dict__, never the object)."""
        self.unsharded: nn.Parameter | None = None
        """Created by the unit's group at its first gather (on the sharded parameter's device)."""
        self.accumulated_grad: torch.Tensor | None = None
        """Unsynced micro-batches' unsharded gradient summed in the reduce dtype, when that
        differs from the compute dtype (FSDP2's rule: bf16 compute accumulates in fp32)."""
        if home.in_files and param.requires_grad:  # its file now, not at the first backward
            self.grad_home = home.tensor(self.local_shape, param.dtype)

    def redeal(self, info: MeshInfo, value: torch.Tensor, rows: bool = False) -> None:
        """Deal the parameter again over `info`'s mesh from its whole `value`, or (`rows`)
        from this rank's rows of it alone (live recovery: another world size). The sharded
        parameter is a new object: an optimizer over the old one must be built again."""
        requires_grad = self.sharded.requires_grad
        self.info = info
        self.piece = piece_of(
            math.prod(self.shape), info.shard_size, info.shard_rank, row_numel(self.shape)
        )
        start, stop = self.rows
        if rows:
            assert value.shape[0] == stop - start, f"{self.fqn}: rows for another layout"
        mine = value.detach() if rows else value.detach()[start:stop]
        local = mine.to(info.device if not self.home.away else "cpu")
        local = self.home.keep(local.contiguous().clone())
        self.spec = _spec(info, self.shape, value.dtype)
        self.sharded = nn.Parameter(_dtensor(local, self.spec), requires_grad=requires_grad)
        self.unsharded, self.accumulated_grad = None, None
        self.grad_home = self.home.tensor(self.local_shape, value.dtype) if requires_grad else None
        self.register(self.sharded)

    @property
    def rows(self) -> tuple[int, int]:
        """The dim-0 rows this rank holds."""
        row = row_numel(self.shape) or 1
        return self.piece.start // row, self.piece.stop // row

    @property
    def local(self) -> torch.Tensor:
        """The shard: the sharded parameter's local tensor."""
        local: torch.Tensor = self.sharded._local_tensor  # type: ignore[attr-defined]
        return local

    @property
    def local_shape(self) -> torch.Size:
        start, stop = self.rows
        return torch.Size([stop - start, *self.shape[1:]])

    def register(self, face: nn.Parameter) -> None:
        for owner, name in self.owners:
            owner._parameters[name] = face

    def adopt_registered(self) -> None:
        """Follow a sharded parameter that was replaced in the module (`load_state_dict(...,
        assign=True)`, `to_empty`, `_apply`): it must stay a DTensor of the same layout."""
        from torch.distributed.tensor import DTensor

        owner, name = self.owners[0]
        current = owner._parameters.get(name)
        if current is self.unsharded:
            return
        if current is self.sharded:  # swapped in place (`_apply`): perhaps a new dtype
            self._follow_dtype(current.dtype)
            return
        if not isinstance(current, DTensor) or current.shape != self.shape:
            raise ConfigurationError(
                f"parameter '{self.fqn}' of a fully_shard unit was replaced by a "
                f"{type(current).__name__} of shape {list(getattr(current, 'shape', []))}, "
                f"not a sharded DTensor of shape {list(self.shape)} — load state with "
                "torch.distributed.checkpoint.state_dict.set_model_state_dict, or load DTensors"
            )
        if tuple(current.placements) != tuple(self.info.placements):
            raise ConfigurationError(
                f"parameter '{self.fqn}' was replaced by a DTensor placed "
                f"{tuple(current.placements)}, not {tuple(self.info.placements)} — distribute "
                "it on the unit's mesh and placements (distribute_tensor)"
            )
        requires_grad = self.sharded.requires_grad
        local = current._local_tensor
        kept = self.home.keep(local.contiguous())
        if kept is not local:  # offloaded: the replacement goes home too
            current = _dtensor(kept, current._spec)
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=requires_grad)
        self.sharded = current
        self._follow_dtype(current.dtype)
        self.register(current)

    def _follow_dtype(self, dtype: torch.dtype) -> None:
        self.spec = _spec(self.info, self.shape, dtype)
        if self.grad_home is not None and self.grad_home.dtype != dtype:
            self.grad_home = None  # the same shape and dtype keep their buffer at home

    def sharded_grad(self, local: torch.Tensor) -> DTensor:
        """A gradient for the sharded parameter from its local part (a view, no copy)."""
        return _dtensor(local.view(self.local_shape), self.spec)

    def set_grad(self, local: torch.Tensor) -> None:
        """Give the sharded parameter `local` as its gradient, or add it to the one it has
        (a second synced backward before the step accumulates, as .grad would). Offloaded:
        through the gradient's buffer at home."""
        grad = self.sharded.grad
        if grad is not None:
            grad._local_tensor.add_(local.view(self.local_shape))  # type: ignore[attr-defined]
            self.home.settle([grad._local_tensor])  # type: ignore[attr-defined]
            return
        if self.home.away:
            if self.grad_home is None:
                self.grad_home = self.home.tensor(self.local_shape, self.sharded.dtype)
            if self.grad_home is not None:
                self.home.store(self.grad_home, local)
                local = self.grad_home
                self.home.settle([local])  # written: a file's pages leave this process
        self.sharded.grad = self.sharded_grad(local)


def _spec(info: MeshInfo, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = _contiguous_strides(shape)
    return DTensorSpec(info.mesh, info.placements, tensor_meta=TensorMeta(shape, stride, dtype))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor from its local tensor and a spec made once (FSDP2's fast path: from_local
    checks and rebuilds the spec on every call)."""
    from torch.distributed.tensor import DTensor

    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:
        from torch.distributed.tensor._dtensor_spec import TensorMeta

        meta = spec.tensor_meta
        spec = type(spec)(
            spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, local.dtype)
        )
    return DTensor(local, spec, requires_grad=False)
