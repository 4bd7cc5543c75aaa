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

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ReplicaDivergenceError
from phalanx.runtime.agree import raise_on_every_rank


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers that ranks must hold alike right now.

    Not the buffers of a DDP that broadcasts them before its next forward:
    BatchNorm's running statistics follow each rank's own batch until then, as in torch.
    """
    module = getattr(model, "module", model)  # a DDP wrapper: its module
    named = list(module.named_parameters())
    if not getattr(model, "forward_sync_buffers", False):
        named += list(module.named_buffers())
    return named


def _by_group(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> tuple[dict[Any, tuple[dist.ProcessGroup | None, list[tuple[str, torch.Tensor]]]], int]:
    """Which ranks must agree on what: plain tensors across `group`; a DTensor's local part
    across each mesh dimension it is replicated over (HSDP: the replicas of a shard). Also
    how many DTensors are replicated over no dimension (nothing to compare them with)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, tuple[dist.ProcessGroup | None, list[tuple[str, torch.Tensor]]]] = {
        "plain": (group, [])
    }
    unreplicated = 0
    for name, t in named:
        if not isinstance(t, DTensor):
            groups["plain"][1].append((name, t))
            continue
        dims = [i for i, p in enumerate(t.placements) if p.is_replicate()]
        unreplicated += not dims
        for dim in dims:
            key = (t.device_mesh, dim)  # meshes compare by value
            if key not in groups:
                groups[key] = (t.device_mesh.get_group(dim), [])
            groups[key][1].append((name, t.to_local()))
    return groups, unreplicated


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
    tensor that differs, the ranks that differ and by how much. A sharded
    (DTensor) parameter is compared across the ranks that replicate its shard
    (HSDP's replicate dimension); one sharded over every rank has no copy to
    compare, which a warning says.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # one process: one replica
    groups, unreplicated = _by_group(_tensors(model), group)
    problem = None
    for members, named in groups.values():
        problem = problem or _difference(named, members)
    if unreplicated:
        compared = sum(len(named) for _, named in groups.values())
        warnings.warn(
            f"check_replicas: {unreplicated} parameters are sharded over every rank, so no "
            f"rank holds a copy to compare them with; compared the {compared} replicated "
            "tensors (buffers, and shards across the replicate dimension of a 2-D mesh)",
            stacklevel=2,
        )
    # A drift inside one replica group must stop every rank, not only that group's.
    error = None if problem is None else ReplicaDivergenceError(problem)
    raise_on_every_rank(error, group, name_the_rank=False)  # the message names the ranks


def _difference(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> str | None:
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
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    return _first_difference(named, everyone, ranks)


def _nccl(group: dist.ProcessGroup | None) -> bool:
    return "nccl" in str(dist.get_backend(group))


def _first_difference(
    named: list[tuple[str, torch.Tensor]], everyone: list[torch.Tensor], ranks: list[int]
) -> str | None:
    """The message for the first tensor whose fingerprints differ from the group's first
    rank's; ranks are named by their global rank."""
    reference = everyone[0]
    for i, (name, tensor) in enumerate(named):
        differing = [r for r, fp in enumerate(everyone) if not torch.equal(fp[i], reference[i])]
        if not differing:
            continue
        worst = max(differing, key=lambda r: float((everyone[r][i] - reference[i]).abs()[0]))
        sum_gap = float((everyone[worst][i][0] - reference[i][0]).abs())
        norm_gap = abs(float(everyone[worst][i][1].sqrt() - reference[i][1].sqrt()))
        return (
            f"replicas differ: '{name}' {list(tensor.shape)} on rank(s) "
            f"{[ranks[r] for r in differing]} is not rank {ranks[0]}'s (rank {ranks[worst]}: its "
            f"sum differs by {sum_gap:.3g}, its norm by {norm_gap:.3g}) — a rank-local buffer, "
            "a non-deterministic op or a bug made the replicas drift; every step from here "
            "trains different models"
        )
    return None
