"""`World`: where this process stands in the job, the group that connects it, and the
few collectives the Trainer needs on it.

A `World` is derived from torch.distributed's state and the launcher's
environment on every call rather than cached, which is what makes `init`
idempotent and lets it describe a group the user built by hand. A single
process has a real one-rank group too, so the collectives need no special case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError
from phalanx.ground.jobenv import LaunchInfo
from phalanx.runtime import wire
from phalanx.runtime.agree import raise_on_every_rank
from phalanx.runtime.backend import current_device

__all__ = ["World", "describe_default_group"]


@dataclass(frozen=True)
class World:
    """Where this process stands in the job, and the group that connects it.

    One object per run, handed to everything that asks which rank this is. It
    changes in one way only, `rebind`, when live recovery forms the group again:
    then every holder sees the new rank at once (no holder keeps a stale copy).
    Compared by value: `init()` called again describes the same World (it is derived
    from torch's state, not cached). Not a dictionary key (a rebind changes its hash).
    """

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

    def rebind(self, rank: int, world_size: int) -> None:
        """This process's place in the group formed again (live recovery: members left or
        joined; the group itself is the default group, re-formed in place). The one change
        a World takes, as torch DDP's `_update_process_group` re-points its reducer: every
        object of the run holds this World, so none is left with the old rank."""
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world_size)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one rank: only then is there anything to communicate."""
        return self.world_size > 1

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum each number over ranks, in float64 so counts stay exact."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.process_group)
        return [float(v) for v in tensor.tolist()]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON: no pickle travels, runtime/wire.py), in rank order."""
        return wire.all_gather_json(obj, self.process_group)

    def all_gather_state(self, obj: Any) -> list[Any]:
        """Every rank's tensors and plain containers (read back with weights_only)."""
        return wire.all_gather_state(obj, self.process_group)

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's `obj` (JSON) on every rank."""
        return wire.broadcast_json(obj, 0, self.process_group)

    def barrier_or_raise(self, error: PhalanxError | None) -> None:
        """A barrier that fails on every rank if it failed on any: pass your error or None.

        `runtime/agree.py: raise_on_every_rank` over this world's group: a failing
        rank raises its own error, the others the first failing rank's, of the
        same class, prefixed with that rank. Every rank must call it.
        """
        raise_on_every_rank(error, self.process_group)


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
