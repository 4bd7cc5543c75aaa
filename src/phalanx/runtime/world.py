"""`World`: where this process stands in the job, and the group that connects it.

It is derived from torch.distributed's state and the launcher's environment
on every call rather than cached, which is what makes `init` idempotent and
lets it describe a group the user built by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.jobenv import LaunchInfo
from phalanx.runtime.backend import current_device

__all__ = ["World", "describe_default_group"]


@dataclass(frozen=True)
class World:
    """Where this process stands in the job, and the group that connects it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    """cuda:local_rank when the backend drives GPUs, else cpu."""
    backend: str
    process_group: dist.ProcessGroup
    """The default (WORLD) group; pass it on explicitly rather than relying on globals."""
    launcher: str
    """One of "env" (phalanx launch / torchrun), "slurm", "mpi", "none" (plain python)."""
    master_addr: str | None
    master_port: int | None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def describe_default_group(info: LaunchInfo) -> World:
    """Describe the existing default group, with node details from the launcher's env."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    if (info.rank, info.world_size) != (rank, world_size):
        # The user built the group by hand with values the environment does not
        # describe: all we know is that the ranks are somewhere.
        info = LaunchInfo("none", rank, rank, world_size, world_size, 0, None, None)
    group = dist.group.WORLD
    assert group is not None  # dist.is_initialized() holds here
    return World(
        rank=rank,
        local_rank=info.local_rank,
        world_size=world_size,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        device=current_device(backend),
        backend=backend,
        process_group=group,
        launcher=info.launcher,
        master_addr=info.master_addr,
        master_port=info.master_port,
    )
