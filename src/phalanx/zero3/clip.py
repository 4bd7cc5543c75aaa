"""`clip_grad_norm_` over a sharded model's gradients: torch's arithmetic, with gradients in
files read one at a time.

torch's own clip over the DTensor gradients is exact, but it reads every gradient
before it scales any: under disk offload that maps every gradient shard's pages into
the process at once (the whole gradient, resident, just before the optimizer step
that streams them a window at a time). Here each file-backed gradient leaves the
process (`Home.settle`) as soon as its norm is taken and again once it is scaled.
The numbers are torch's: the same per-tensor norms (each (device, dtype) group in
the order torch takes them, foreach where torch would use it), stacked and normed
as torch does, and the same scaling by `min(max_norm / (norm + 1e-6), 1)`, skipped
where that is 1 (a norm under the bound): multiplying by 1.0 changes no bit, and would
read and dirty every gradient page again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._foreach_utils import _has_foreach_support

from phalanx.zero3.home import Home
from phalanx.zero3.wrap import params_in_files

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's `clip_grad_norm_` over the model's DTensor gradients; the norm as a plain
    tensor (torch returns a DTensor), the same on every rank."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    in_files = _file_homes(model)
    if not any(id(p) in in_files for p in params):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    else:
        norm = _total_norm(params, float(norm_type), in_files)
        coefficient = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        scaling = not bool(coefficient == 1.0)  # x * 1.0 is x, bit for bit: nothing to touch
        for p in params if scaling else []:
            grad = p.grad
            assert grad is not None
            if _has_foreach_support([grad], grad.device):
                torch._foreach_mul_([grad], coefficient.to(grad.device))
            else:
                grad.mul_(coefficient.to(grad.device))
            _settle(p, in_files)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _total_norm(
    params: list[nn.Parameter], norm_type: float, in_files: dict[int, Home]
) -> torch.Tensor:
    """torch's total norm (clip_grad's `_get_total_norm`), one gradient at a time."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        assert p.grad is not None
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    norms: list[torch.Tensor] = []
    for members in groups.values():
        for p in members:
            assert p.grad is not None
            grad = p.grad
            if _has_foreach_support([grad], grad.device):
                norms.extend(torch._foreach_norm([grad], norm_type))
            else:
                norms.append(torch.linalg.vector_norm(grad, norm_type))
            _settle(p, in_files)
    first = params[0].grad
    assert first is not None
    return torch.linalg.vector_norm(torch.stack([n.to(first.device) for n in norms]), norm_type)


def _file_homes(model: nn.Module) -> dict[int, Home]:
    """The sharded parameters whose gradients live in files, by id: their homes."""
    return {id(p.sharded): p.home for p in params_in_files(model)}


def _settle(p: nn.Parameter, in_files: dict[int, Home]) -> None:
    home = in_files.get(id(p))
    if home is not None and p.grad is not None:
        home.settle([p.grad._local_tensor])  # type: ignore[attr-defined]
