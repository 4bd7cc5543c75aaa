"""The process group of a live-recovery run: one object for the whole run, over a gloo group
that is formed again, with a new store prefix, whenever the membership changes.

Gloo's collectives cannot be cancelled (`abort()` and `shutdown()` leave a blocked
wait blocked, and a peer blocked on us stays blocked too), and a group cannot
lose a rank. So the outer group (`LiveGroup`, a Python `ProcessGroup` that every
`dist.*` call and the reducer accept) hands each collective to the current inner
gloo group and waits for it in short slices; between slices it looks at a flag a
watcher thread keeps from the store. A member that sees a collective fail (a
dead peer's sockets close at once) or learns of a loss from its launcher marks
the generation aborted in the store, so that every member leaves its wait within
a slice, with `PeerLost`; the abandoned inner group is kept, never destroyed (its
threads may still be blocked on a stopped peer), and once the next generation has
formed, its connections are shut down (`gloo_sockets.py`: a pair left mid-send would
otherwise keep its loop thread busy). `membership.py` then agrees on
the next members and this group's `reform` builds the inner group for them.
Design and alternatives: docs/reliability.md, "Live recovery".
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from phalanx.errors import NotAMember, PeerLost, StoreLost
from phalanx.ground.live_store import KeyValue, LiveStore
from phalanx.ground.runauth import TAG_BYTES, RunKey
from phalanx.ground.store_keys import (
    KEY,
    MEMBER_ENV,
    abort_key,
    grow_key,
)
from phalanx.runtime.gloo_sockets import GroupSockets
from phalanx.runtime.heartbeat import start_heartbeat

__all__ = ["LIVE_BACKEND", "LiveGroup", "current_live_group", "delegate_collectives"]

LIVE_BACKEND = "phalanx_live"
"""The backend name `init_process_group` is given under live recovery (runtime/__init__)."""


_SLICE = timedelta(seconds=0.05)
"""How long a collective waits before it looks at the abort flag again: the members that
wait on a peer in a collective learn of a change of members this late at most, beyond
the watcher's own period (0.2 s made the agreement of a change 0.2 s, measured)."""
_WATCH_S = 0.1
_END_WATCH_S = 5.0


def current_live_group() -> LiveGroup | None:
    """The live group this process joined, if it runs under live recovery: the default
    group itself (`init_process_group` made it), so no table of our own keeps it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    return world if isinstance(world, LiveGroup) else None


class _LiveWork(dist._Work):
    """A collective of the inner group, waited for in slices that notice an abort."""

    def __init__(self, group: LiveGroup, inner: dist.Work, generation: int) -> None:
        super().__init__()
        self._group = group
        self._inner = inner
        self._generation = generation

    def wait(self, timeout: timedelta | None = None) -> bool:
        while True:
            self._group.raise_if_aborted(self._generation)
            try:
                return bool(self._inner.wait(_SLICE))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower():
                    continue
                reason = f"a collective failed ({_first_line(exc)})"
                raise self._group.lost(reason, self._generation) from exc

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = self._inner.get_future()
        return future


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


_OPS = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast",
    "allgather": "allgather",
    "_allgather_base": "_allgather_base",
    "all_gather_single": "_allgather_base",  # torch 2.13's names for the same collectives
    "allgather_coalesced": "allgather_coalesced",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall_base": "alltoall_base",
    "all_to_all_single": "alltoall_base",
    "alltoall": "alltoall",
    "send": "send",
    "recv": "recv",
    "barrier": "barrier",
}
"""Our name -> the inner gloo group's: every collective torch.distributed calls a group by."""


class LiveGroup(dist.ProcessGroup):
    """The run's process group under live recovery (module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        key: RunKey,
        replacement: str | None = None,
    ) -> None:
        """The first workers are members `r<rank>` of generation 0; a `replacement` (`j<n>`)
        has no group until `LiveRecovery.join` lets it in. `key`: the run's secret, which
        every value read from the store and every member of a group must prove."""
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know one overload
        self.store = store
        """The job's store, unprefixed: each generation's prefix for gloo's own keys."""
        self.key = key
        self.live_store = LiveStore(cast(KeyValue, store), key)
        """The protocol's keys, signed (ground/live_store.py)."""
        self.timeout = timeout
        self.generation = 0 if replacement is None else -1
        self.members: list[str] = [f"r{r}" for r in range(size)] if replacement is None else []
        self.member = replacement or f"r{rank}"
        self.connections = GroupSockets()
        """The connections of each generation's gloo groups: shut down once it is over."""
        self._inner: dist.ProcessGroupGloo | None = None
        if replacement is None:
            self._inner = self._gloo(0, rank, size)
            self._prove(self._inner, 0, self.members, rank, timeout)
        else:  # a world of its own until it joins: what it builds before (a mesh) needs one
            alone = dist.PrefixStore(f"{KEY}alone/{replacement}/", store)
            self._inner = dist.ProcessGroupGloo(alone, 0, 1, timeout)  # no connections
        self._bind(self._inner)
        self._rank, self._size = rank, size
        self._aborted: dict[int, str] = {}
        self.store_lost: str | None = None
        """Why the job's store answers no more (etcd without a quorum, seen by the watcher):
        every collective from then on raises `StoreLost`, on every member."""
        self._grow_asked: set[int] = set()
        self._abandoned: list[dist.ProcessGroupGloo] = []
        self._lock = threading.Lock()
        self._watch_store = LiveStore(cast(KeyValue, store.clone()), key)  # type: ignore[attr-defined]
        self._stop_watching = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="phalanx-live", daemon=True)
        self._watcher.start()
        atexit.register(self._end_watch)
        start_heartbeat(self.member)

    # ------------------------------------------------------------ the group
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return LIVE_BACKEND

    def parts(self) -> tuple[LiveGroup, dist.ProcessGroupGloo | None, int]:
        """What a collective goes through: this group, the generation's gloo, its number."""
        return self, self._inner, self.generation

    def _gloo(
        self, generation: int, rank: int, size: int, connect: timedelta | None = None
    ) -> dist.ProcessGroupGloo:
        """Generation `generation`'s gloo group: connected within `connect`, its collectives
        bounded by the run's timeout."""
        prefix = dist.PrefixStore(f"{KEY}g{generation}/pg/", self.store)
        group = self.connections.made(
            generation, lambda: dist.ProcessGroupGloo(prefix, rank, size, connect or self.timeout)
        )
        group._set_default_timeout(self.timeout)
        return group

    def reform(self, generation: int, members: list[str], member: str, connect: timedelta) -> None:
        """Connect to `members` as generation `generation` (every one of them calls this;
        one that does not within `connect` makes it PeerLost on the others)."""
        rank = members.index(member)
        try:
            inner = self._gloo(generation, rank, len(members), connect)
            self._prove(inner, generation, members, rank, connect)
        except (RuntimeError, PeerLost) as exc:
            self._abandon(generation, members, member)
            if isinstance(exc, PeerLost):
                raise
            raise PeerLost(
                f"generation {generation}: a member did not connect ({_first_line(exc)})"
            ) from exc
        with self._lock:
            if self._inner is not None:
                self._abandoned.append(self._inner)
            self._inner = inner
            self.generation, self.members, self.member = generation, members, member
            self._rank, self._size = rank, len(members)
            self._bind(inner)
        self.connections.end_before(generation)

    def _bind(self, inner: dist.ProcessGroupGloo) -> None:
        """Make `inner` this group's registered CPU backend, and name the group again (torch
        reads the name from its backend). What torch calls through Python (every `dist.*`
        collective) reaches our methods above; what it dispatches in C++ (DTensor's functional
        collectives, a DeviceMesh over this group) reaches the current generation's gloo."""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)
        world = dist.distributed_c10d._world
        name = world.pg_names.get(self)
        if name:
            self._set_group_name(name)
        if self in world.pg_group_ranks:  # the default group: global ranks are its own now
            world.pg_group_ranks[self] = {r: r for r in range(inner.size())}

    def _abandon(self, generation: int, members: list[str], member: str) -> None:
        """`generation` was agreed but could not form (a member died or failed its proof):
        it is over, and the next one is agreed from its members (so not the same again)."""
        with self._lock:
            if self._inner is not None:
                self._abandoned.append(self._inner)
            self._inner = None
            self.generation, self.members, self.member = generation, members, member
            self._aborted.setdefault(generation, "it could not form")
        self.connections.end_before(generation + 1)  # this one is over too

    def _prove(
        self,
        inner: dist.ProcessGroupGloo,
        generation: int,
        members: list[str],
        rank: int,
        timeout: timedelta,
    ) -> None:
        """Every rank of a new group shows a tag only the run's secret makes, bound to the
        generation, its rank and name and the roster: a stranger that slipped into gloo's
        rendezvous (its addresses are in the store too) is found here, before any data
        moves. NotAMember naming it otherwise."""
        roster = json.dumps(members).encode()

        def tag(r: int) -> bytes:
            return self.key.tag(
                b"member", b"%d" % generation, b"%d" % r, members[r].encode(), roster
            )

        mine = torch.frombuffer(bytearray(tag(rank)), dtype=torch.uint8)
        out = [torch.empty(TAG_BYTES, dtype=torch.uint8) for _ in members]
        cast(dist.ProcessGroup, inner).allgather([out], [mine]).wait(timeout)
        for r, got in enumerate(out):
            if not hmac.compare_digest(got.numpy().tobytes(), tag(r)):
                raise NotAMember(
                    f"generation {generation}: rank {r} (claiming to be {members[r]}) does not "
                    "hold the run's secret — someone outside the run joined its group; it is "
                    "formed again without trusting it (docs/reliability.md, 'Who can steer a run')"
                )

    # ------------------------------------------------------------ aborting
    def raise_if_aborted(self, generation: int | None = None) -> None:
        """PeerLost when the generation (the current one by default) was aborted; StoreLost
        when the store is gone (nothing can be agreed any more: the run stops)."""
        if self.store_lost is not None:
            raise StoreLost(self.store_lost)
        gen = self.generation if generation is None else generation
        if gen < 0 and self._size != 1:
            raise PeerLost(f"{self.member} is a replacement that has not joined the run yet")
        reason = self._aborted.get(gen)
        if reason is not None or gen != self.generation:
            raise PeerLost(f"generation {gen} ended: {reason or 'the group was formed again'}")

    def lost(self, reason: str, generation: int | None = None) -> PeerLost:
        """Mark the current generation aborted for every member; the error to raise here. A
        collective of an earlier `generation` (a side group's) ends only itself."""
        gen = self.generation
        if generation is not None and generation != gen:
            return PeerLost(f"generation {generation} ended: {reason}")
        self.live_store.end_generation(gen, self.member, reason)
        self._aborted.setdefault(gen, reason)
        return PeerLost(f"generation {gen} ended: {reason}")

    def grow_requested(self) -> bool:
        """Whether a replacement waits to join the current generation (seen by the watcher)."""
        return self.generation in self._grow_asked

    def _watch(self) -> None:
        """Keep `_aborted` and `_grow_asked` in step with the store (a daemon thread)."""
        store = self._watch_store
        while not self._stop_watching.wait(_WATCH_S):
            gen = self.generation
            try:
                if gen not in self._aborted:
                    reason = store.read(abort_key(gen))
                    if reason is not None:
                        self._aborted[gen] = reason
                if gen not in self._grow_asked and store.read(grow_key(gen)) is not None:
                    self._grow_asked.add(gen)
            except StoreLost as exc:  # etcd: the peers still answer, so no collective would say
                self.store_lost = str(exc)
                return
            except RuntimeError:  # the store went away: the next collective fails and says so
                return

    def _end_watch(self) -> None:
        """At exit, before the interpreter finalizes: a daemon thread caught inside a store
        call then aborts the process ("terminate called without an active exception")."""
        self._stop_watching.set()
        self._watcher.join(timeout=_END_WATCH_S)


def _delegate(name: str, inner_name: str) -> Callable[..., dist.Work]:
    """`name` of a LiveGroup or a SideGroup: the inner gloo group's `inner_name`, started
    unless its generation ended, waited for in slices."""

    def op(self: Any, *args: Any) -> dist.Work:  # a LiveGroup or a SideGroup
        live, group, generation = self.parts()
        live.raise_if_aborted(generation)
        try:
            inner = getattr(group, inner_name)(*args)  # raise_if_aborted: joined, so set
        except RuntimeError as exc:
            reason = f"a collective could not start ({_first_line(exc)})"
            raise live.lost(reason, generation) from exc
        return _LiveWork(live, inner, generation)

    op.__name__ = name
    op.__doc__ = f"The inner gloo group's {name}, waited for in slices."
    return op


def delegate_collectives(cls: type) -> None:
    """Give `cls` (a LiveGroup, a SideGroup: each with `parts()`) every collective
    torch.distributed calls a group by, each run by `_delegate`."""
    for name, inner_name in _OPS.items():
        setattr(cls, name, _delegate(name, inner_name))


delegate_collectives(LiveGroup)


def create_live_group(
    store: dist.Store, rank: int, size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """`dist.Backend.register_backend`'s creator: the store `init_process_group` passes is
    its own prefix over the job's; the protocol uses the job's store itself."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    key = RunKey.from_env()
    return LiveGroup(store, rank, size, timeout, key, os.environ.get(MEMBER_ENV) or None)


def register_live_backend() -> None:
    """Make `init_process_group(LIVE_BACKEND, ...)` build a `LiveGroup` (idempotent)."""
    if LIVE_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(LIVE_BACKEND, create_live_group, devices=["cpu"])
