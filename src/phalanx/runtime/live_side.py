"""Gloo groups beside the run's under live recovery: a second one over every member, for a
thread of its own (the background checkpoint writer: train/checkpoint/background.py), or
one over some of the members (HSDP's rows and columns: zero3/hybrid.py). Made per
generation, their waits end as the run's do when the generation ends (runtime/live.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group

from phalanx.ground.store_keys import KEY
from phalanx.runtime.live import LIVE_BACKEND, LiveGroup, _first_line, delegate_collectives

__all__ = ["SideGroup"]


class SideGroup(dist.ProcessGroup):
    """One generation's gloo group over `ranks` of its members (default: all of them): its
    collectives, apart from the training thread's, end with PeerLost, within a slice, once
    that generation is over (a member lost or a replacement let in), instead of blocking
    on a member that will never answer. Registered with torch like `dist.new_group`'s
    groups, by name too (DTensor's collectives find a mesh's groups by it); `dist.new_group`
    itself cannot be used: its name comes from a count of the groups a process made, which
    a replacement does not share. Made by the members of `ranks` together (`name` the same
    on all of them, and unique in the generation), and proved with the run's secret like
    the run's own group."""

    def __init__(
        self,
        live: LiveGroup,
        name: str,
        ranks: list[int] | None = None,
        connect: timedelta | None = None,
    ) -> None:
        generation = live.generation
        ranks = list(range(live.size())) if ranks is None else list(ranks)
        rank, size = ranks.index(live.rank()), len(ranks)
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know one overload
        prefix = dist.PrefixStore(f"{KEY}g{generation}/{name}/", live.store)
        connect = connect or live.timeout
        try:  # a member lost meanwhile never connects: the generation ends within `connect`
            self._inner = live.connections.made(
                generation, lambda: dist.ProcessGroupGloo(prefix, rank, size, connect)
            )
            self._inner._set_default_timeout(live.timeout)
            live._prove(self._inner, generation, [live.members[r] for r in ranks], rank, connect)
        except RuntimeError as exc:
            reason = f"its {name} group did not form ({_first_line(exc)})"
            raise live.lost(reason, generation) from exc
        self._live, self.generation = live, generation
        self._rank, self._size = rank, size
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._inner)
        world = dist.distributed_c10d._world
        group_name = dist.distributed_c10d.GroupName(f"{LIVE_BACKEND}_g{generation}_{name}")
        self._set_group_name(group_name)
        world.pg_map[self] = ("gloo", prefix)
        world.pg_names[self] = group_name
        world.pg_group_ranks[self] = {g: r for r, g in enumerate(ranks)}  # generation's ranks
        world.pg_backend_config[self] = "gloo"
        _register_process_group(group_name, self)

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
