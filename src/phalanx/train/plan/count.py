"""What a model allocates, counted on the meta device: no byte of it is ever made.

The parameters' sizes, the stage-3 units the Trainer would make (its own
`repeated_blocks`, or `zero3_units`), and one micro-step run for real on meta
tensors: every tensor autograd saves for backward is seen by a saved-tensor hook
(activations: the bytes of their storages, each once, parameters excluded), and
torch's `FlopCounterMode` counts the forward's and backward's floating-point
operations. The micro-step runs at two micro-batch sizes, so activations and
operations are known as a fixed part plus a part per sample, and scale to any
micro-batch. The optimizer's state per parameter byte is measured by stepping
the optimizer itself once over a small real tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.flop_counter import FlopCounterMode

from phalanx.errors import ConfigurationError
from phalanx.runtime.nested import map_tensors
from phalanx.zero3.auto_wrap import by_class_names, repeated_blocks

__all__ = ["MicroStep", "ModelCount", "count_model", "state_per_param_byte"]

MicroStep = Callable[[nn.Module, int], torch.Tensor]
"""Runs one micro-batch of `n` samples through the model, returning the loss."""

_PROBE_SIZES = (1, 2)
"""Micro-batch sizes the meta micro-step runs at: two points fix a line."""


@dataclass(frozen=True)
class ModelCount:
    """A model's sizes in bytes, and its activations and operations per micro-batch."""

    param_bytes: tuple[int, ...]
    """Each trainable parameter's whole size (a tied one once), in registration order."""
    frozen_bytes: int
    """Parameters without gradients and buffers: held whole at every stage."""
    unit_bytes: tuple[int, ...]
    """Stage 3's units, each the bytes of the parameters it gathers (the root last)."""
    unit_names: tuple[str, ...]
    activation_fixed: float
    activation_per_sample: float
    """Bytes autograd saves for backward in a micro-batch of n: fixed + n x per_sample."""
    flops_fixed: float
    flops_per_sample: float
    """Forward and backward operations in a micro-batch of n: fixed + n x per_sample."""
    state_per_param_byte: float
    """The optimizer's state per byte of parameter (AdamW: 2; SGD without momentum: 0)."""

    @property
    def params(self) -> int:
        """The trainable parameters' bytes."""
        return sum(self.param_bytes)

    @property
    def largest_unit(self) -> int:
        return max(self.unit_bytes, default=0)

    def activations(self, micro_batch: int) -> float:
        return self.activation_fixed + micro_batch * self.activation_per_sample

    def flops(self, micro_batch: int) -> float:
        return self.flops_fixed + micro_batch * self.flops_per_sample


def count_model(
    model: nn.Module,
    micro_step: MicroStep,
    optimizer: Callable[[list[nn.Parameter]], Optimizer],
    unit_classes: Sequence[str] | None = None,
) -> ModelCount:
    """Count `model` (meta or real: nothing of it is allocated or changed) and the optimizer
    `optimizer(params)` makes (see the module doc)."""
    trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if not trainable:
        raise ConfigurationError(
            "the model has no trainable parameter — unfreeze some (requires_grad=True)"
        )
    ids = {id(p) for p in trainable}
    frozen = [p for p in model.parameters() if id(p) not in ids]
    frozen_bytes = sum(_nbytes(t) for t in [*frozen, *model.buffers()])
    names, units = _units(model, unit_classes)
    points = [_meta_micro_step(model, micro_step, n) for n in _PROBE_SIZES]
    (a1, f1), (a2, f2) = points
    span = _PROBE_SIZES[1] - _PROBE_SIZES[0]
    act_slope, flop_slope = (a2 - a1) / span, (f2 - f1) / span
    return ModelCount(
        param_bytes=tuple(_nbytes(p) for p in trainable),
        frozen_bytes=frozen_bytes,
        unit_bytes=tuple(units),
        unit_names=tuple(names),
        activation_fixed=max(0.0, a1 - act_slope * _PROBE_SIZES[0]),
        activation_per_sample=max(0.0, act_slope),
        flops_fixed=max(0.0, f1 - flop_slope * _PROBE_SIZES[0]),
        flops_per_sample=max(0.0, flop_slope),
        state_per_param_byte=state_per_param_byte(optimizer),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _units(model: nn.Module, unit_classes: Sequence[str] | None) -> tuple[list[str], list[int]]:
    """What `zero3.shard_model` would make units of (its own policies), and the root's rest."""
    picked = by_class_names(unit_classes)(model) if unit_classes else repeated_blocks(model)
    taken: set[int] = set()
    names, sizes = [], []
    for module in picked:
        own = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
        taken.update(id(p) for p in own)
        names.append(type(module).__name__)
        sizes.append(sum(_nbytes(p) for p in own))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    names.append("root")
    sizes.append(sum(_nbytes(p) for p in {id(p): p for p in rest}.values()))
    return names, sizes


def _meta_micro_step(model: nn.Module, micro_step: MicroStep, n: int) -> tuple[float, float]:
    """(bytes saved for backward, operations) of one micro-batch of `n` on meta tensors: the
    model's own tensors are swapped for meta ones for the call (torch.func.functional_call),
    so a real model is neither copied nor touched."""
    meta = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    own = {t.untyped_storage()._cdata for t in meta.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:
            saved[storage._cdata] = storage.nbytes()
        return t

    shim = _Functional(model, meta)
    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = micro_step(shim, n)
        loss.backward()
    return float(sum(saved.values())), float(flops.get_total_flops())


class _Functional(nn.Module):
    """The model called with other tensors in place of its own (a view for `micro_step`)."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._inner = [model]  # a list: not registered as a submodule
        self.tensors = tensors

    @property
    def original(self) -> nn.Module:
        """The model itself (its forward's signature says how a batch is passed)."""
        return self._inner[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.original, self.tensors, args, kwargs)


def state_per_param_byte(optimizer: Callable[[list[nn.Parameter]], Optimizer]) -> float:
    """The state `optimizer` keeps per byte of parameter, from one real step over a small
    tensor (its tensors of more than one element: step counts are scalars)."""
    param = nn.Parameter(torch.zeros(1024))
    opt = optimizer([param])
    param.grad = torch.zeros_like(param)
    opt.step()
    tensors = [v for v in opt.state[param].values() if torch.is_tensor(v) and v.numel() > 1]
    return sum(_nbytes(t) for t in tensors) / _nbytes(param)


def meta_batch(batch: Any) -> Any:
    """A batch's tensors as meta tensors of the same shapes and dtypes."""
    return map_tensors(lambda t: torch.empty_like(t, device="meta"), batch)
