"""How a window of offloaded state is stepped: torch's fused CPU Adam where the user left
the choice to torch, and the local tensor a DTensor's step reads (and one put back)."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def like(value: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """`inner` in `value`'s place: itself for a plain tensor, for a DTensor a DTensor of the
    same mesh, placements and global shape over `inner` as its local tensor."""
    if local(value) is value:
        return inner
    from torch.distributed.tensor import DTensor

    assert isinstance(value, DTensor)
    return DTensor.from_local(
        inner,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def fuse_where_default(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Have torch's Adam / AdamW step these groups with its fused CPU kernel where the
    user left the choice to torch (foreach and fused None; on CPU torch would run the
    per-tensor loop): one pass over each window's pages instead of one per operation,
    several times faster on CPU (docs/zero.md, "Offload"). The groups changed, to restore
    after the step, so that checkpoints and the user see the settings they gave."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        return []
    changed = []
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None:
            continue
        if group.get("differentiable") or group.get("capturable"):
            continue
        params = [local(p) for p in group["params"]]
        if all(p.device.type == "cpu" and p.is_floating_point() for p in params):
            group["fused"] = True
            changed.append(group)
    return changed
