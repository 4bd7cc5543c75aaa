"""Offloaded state: the policies, tensors in files (`files.py`) and the optimizer step that
streams them (`stream.py`). ZeRO's stages 1-3 use them; see docs/zero.md, "Offload"."""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist
from torch.optim import Optimizer

from phalanx.errors import ConfigurationError
from phalanx.offload.files import OffloadFiles
from phalanx.offload.fraction import largest_first
from phalanx.offload.fused import local
from phalanx.offload.policies import CPUOffloadPolicy, DiskOffloadPolicy, OffloadPolicy
from phalanx.offload.scratch import sweep_dead_runs
from phalanx.offload.stream import IOStats, Streamer
from phalanx.offload.streamed import stream_optimizer, streamer_of

__all__ = [
    "CPUOffloadPolicy",
    "DiskOffloadPolicy",
    "IOStats",
    "OffloadFiles",
    "OffloadPolicy",
    "Streamer",
    "offload_optimizer",
    "stream_optimizer",
    "streamer_of",
    "sweep_dead_runs",
]

OptimizerT = TypeVar("OptimizerT", bound=Optimizer)


def offload_optimizer(
    optimizer: OptimizerT, policy: DiskOffloadPolicy, group: dist.ProcessGroup | None = None
) -> OptimizerT:
    """Keep `optimizer`'s state in files under `policy.path` and step it a window at a time.

    Call it once the optimizer is built (over a fully_shard model's parameters,
    or any model's): the state it creates from then on, or loads, goes to
    files. `group`: the ranks that step together (default: the parameters'
    mesh, else every rank); a full disk on one of them is raised on all.
    Returns `optimizer` itself, whose class is now `Offloaded<Class>`.
    """
    if not isinstance(policy, DiskOffloadPolicy):
        raise ConfigurationError(
            f"offload_optimizer(policy={policy!r}) needs a phalanx.DiskOffloadPolicy(path) — "
            "CPUOffloadPolicy needs no call: the state is made where the shards are"
        )
    if group is None and dist.is_available() and dist.is_initialized():
        group = _group_of(optimizer)
    streamer = stream_optimizer(optimizer, policy.files(), policy.window_bytes, group)
    streamer.in_files = _state_in_files(optimizer, policy)  # before any state exists
    return optimizer


def _state_in_files(optimizer: Optimizer, policy: DiskOffloadPolicy) -> set[int] | None:
    """The parameters whose state a fractional offload puts in files (None: all): under
    order "largest" at stage 3 those whose shards are in files, else the largest up to the
    state's share of the fraction (offload/fraction.py)."""
    if policy.fraction >= 1.0:
        return None
    params = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
    sharded = any(hasattr(p, "_local_tensor") for p in params)  # stage 3's DTensors
    if sharded and policy.params and policy.order == "largest":
        files = policy.files()
        return {id(p) for p in params if files.holds(local(p))}
    sizes = [(id(p), local(p).numel() * p.element_size()) for p in params]
    return largest_first(sizes, policy.state_share(sharded))


def _group_of(optimizer: Optimizer) -> dist.ProcessGroup | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.ndim == 1:
                return mesh.get_group()
            if mesh is not None:
                return dist.group.WORLD
    return dist.group.WORLD
