"""`check_replicas(model)`: prove that every rank holds the same model, cheaply.

Data parallelism is only right while the replicas are identical, and nothing
in torch checks it: a rank-local buffer, a non-deterministic kernel or a bug
makes them drift silently, and the run is wasted without a sign. Each rank
reduces every parameter and buffer to a fingerprint (its sum and its sum of
squares, in float64: the same bits on every rank for the same tensor, and a
change of one element in one tensor shows), and one small all-gather compares
them. On a mismatch every rank raises the same error, naming the first tensor
that differs, the ranks that differ from rank 0 and by how much.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import PhalanxError


class ReplicaDivergenceError(PhalanxError):
    """The replicas of the model are not identical across ranks."""


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers that every rank must hold alike right now.

    Not a fully_shard piece (each rank holds its own by design), and not the
    buffers of a DDP that broadcasts them before its next forward: BatchNorm's
    running statistics follow each rank's own batch until then, as in torch.
    """
    module = getattr(model, "module", model)  # a DDP wrapper: its module
    named = list(module.named_parameters())
    if not getattr(model, "forward_sync_buffers", False):
        named += list(module.named_buffers())
    return [(name, t) for name, t in named if not hasattr(t, "piece")]


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len(tensors), 2) float64: each tensor's sum and sum of squares."""
    rows = []
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1).to(torch.float64)
            rows.append(torch.stack([flat.sum(), flat.square().sum()]))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.float64)
    return torch.stack(rows).cpu()


def check_replicas(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Collective: return quietly if every rank holds the same parameters and buffers.

    Otherwise raise `ReplicaDivergenceError` on every rank, naming the first
    tensor that differs, the ranks that differ from rank 0 and by how much.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # one process: one replica
    named = _tensors(model)
    mine = fingerprints([t for _, t in named])
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else None
    if device is not None:  # NCCL gathers device tensors only
        mine_dev = mine.to(device)
        gathered = [t.to(device) for t in everyone]
        dist.all_gather(gathered, mine_dev, group=group)
        everyone = [t.cpu() for t in gathered]
    else:
        dist.all_gather(everyone, mine, group=group)
    _raise_if_different(named, everyone)


def _nccl(group: dist.ProcessGroup | None) -> bool:
    return "nccl" in str(dist.get_backend(group))


def _raise_if_different(
    named: list[tuple[str, torch.Tensor]], everyone: list[torch.Tensor]
) -> None:
    reference = everyone[0]
    for i, (name, tensor) in enumerate(named):
        differing = [r for r, fp in enumerate(everyone) if not torch.equal(fp[i], reference[i])]
        if not differing:
            continue
        worst = max(differing, key=lambda r: float((everyone[r][i] - reference[i]).abs()[0]))
        sum_gap = float((everyone[worst][i][0] - reference[i][0]).abs())
        norm_gap = abs(float(everyone[worst][i][1].sqrt() - reference[i][1].sqrt()))
        raise ReplicaDivergenceError(
            f"replicas differ: '{name}' {list(tensor.shape)} on rank(s) {differing} is not "
            f"rank 0's (rank {worst}: its sum differs by {sum_gap:.3g}, its norm by "
            f"{norm_gap:.3g}) — a rank-local buffer, a non-deterministic op or a bug made the "
            "replicas drift; every step from here trains different models"
        )
