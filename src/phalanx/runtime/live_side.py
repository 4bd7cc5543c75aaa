"""A second gloo group beside the run's under live recovery, for a thread of its own (the
background checkpoint writer: train/checkpoint/background.py): made per generation, its
waits end as the run's do when the generation ends (runtime/live.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.ground.store_keys import KEY
from phalanx.runtime.live import LIVE_BACKEND, LiveGroup, delegate_collectives

__all__ = ["SideGroup"]


class SideGroup(dist.ProcessGroup):
    """One generation's second gloo group, over its members: a thread's collectives
    apart from the training thread's, which end with PeerLost, within a slice, once that
    generation is over (a member lost or a replacement let in), instead of blocking on a
    member that will never answer. Registered with torch like `dist.new_group`'s groups
    (`dist.new_group` itself cannot be used: its name comes from a count of the groups a
    process made, which a replacement does not share). Made by every member together,
    and proved with the run's secret like the run's own group."""

    def __init__(self, live: LiveGroup, name: str) -> None:
        generation, rank, size = live.generation, live.rank(), live.size()
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know one overload
        prefix = dist.PrefixStore(f"{KEY}g{generation}/{name}/", live.store)
        self._inner = dist.ProcessGroupGloo(prefix, rank, size, live.timeout)
        self._inner._set_default_timeout(live.timeout)
        live._prove(self._inner, generation, live.members, rank, live.timeout)
        self._live, self.generation = live, generation
        self._rank, self._size = rank, size
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._inner)
        world = dist.distributed_c10d._world
        group_name = dist.distributed_c10d.GroupName(f"{LIVE_BACKEND}_g{generation}_{name}")
        self._set_group_name(group_name)
        world.pg_map[self] = ("gloo", prefix)
        world.pg_names[self] = group_name
        world.pg_group_ranks[self] = {r: r for r in range(size)}  # the generation's ranks
        world.pg_backend_config[self] = "gloo"

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return "gloo"

    def parts(self) -> tuple[LiveGroup, dist.ProcessGroupGloo, int]:
        """What a collective goes through: the run's group, this gloo group, its generation."""
        return self._live, self._inner, self.generation


delegate_collectives(SideGroup)
