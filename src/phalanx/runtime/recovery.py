"""What a training loop does under live recovery: check at each step boundary, recover
after `PeerLost`, and, as a replacement, join; the state travels from a live peer.

The loop keeps its state as of the last step it applied (an aborted step is
never applied: its gradients are dropped). Members can differ by one applied
step: a ring all-reduce may complete on one rank and fail on another when a
peer dies inside it. So after the members are agreed each says how many steps
it applied, the first member with the most is the donor, and its state (the
loop's `save()`: model, optimizer, sampler position, counters) is broadcast
over the new group to every member behind it, replacements included. Either
every member applies a step or none does, and no step applied anywhere is
lost.

The donor's state arrives with a tag (an HMAC of its bytes under the run's secret,
bound to the generation): a member loads only bytes a member of this run sent, and
loads them with `weights_only=True`. No collective here carries a pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import NotAMember, PeerLost
from phalanx.ground.runauth import TAG_BYTES
from phalanx.runtime.live import LiveGroup
from phalanx.runtime.membership import Membership, Settings

__all__ = ["LiveRecovery", "Recovered"]

SaveFn = Callable[[], dict[str, Any]]
LoadFn = Callable[[dict[str, Any]], None]
Sync = Callable[[], tuple[int, str, bool]]
"""Bring every member of the new group to one state: (its step, who provided it, whether
this member loaded it)."""


@dataclass(frozen=True)
class Recovered:
    """What one recovery did, for the log line and the tests."""

    generation: int
    members: list[str]
    rank: int
    world_size: int
    step: int
    """The step every member is at now (the donor's)."""
    donor: str
    received: bool
    """Whether this member loaded the donor's state."""
    seconds: float
    reason: str
    phases: dict[str, float] = field(default_factory=dict)
    """Where `seconds` went: "agree" (the members, through the store), "connect" (the new
    gloo group and its proof), "state" (the donor's state, or the sharded sync)."""


class LiveRecovery:
    """The loop's side of live recovery over the run's `LiveGroup`."""

    def __init__(
        self, group: LiveGroup, settings: Settings, admit_at: Collection[int] | None = None
    ) -> None:
        """`admit_at`: the steps at which replacements are let in (a replay of a run's
        membership: REPLAY_ENV); None lets one in at the first boundary it waits at."""
        self.group = group
        self.settings = settings
        self.membership = Membership(group, settings)
        self.admit_at = None if admit_at is None else set(admit_at)
        self._connect = timedelta(seconds=settings.settle_s)

    def boundary(self, step: int, before_grow: Callable[[], None] = lambda: None) -> None:
        """Between steps (`step` applied): PeerLost if the generation ended, or (on rank 0)
        to let a waiting replacement in, so every member leaves at this boundary or in the
        next step's first collective (the others notice within the store watcher's look,
        0.1 s: a loop with a collective at its boundaries does better with `wants_grow`,
        as the Trainer does). `before_grow`: what rank 0 finishes first (the generation's
        end would cut it: its part of a background save)."""
        if self.wants_grow(step):
            self.grow(before_grow)

    def wants_grow(self, step: int) -> bool:
        """Between steps (`step` applied): PeerLost if the generation ended; whether this
        member (rank 0) lets a waiting replacement in here. The members then agree on it
        at this boundary (the Trainer's boundary vote) and `grow` together, so none is
        left waiting in the next step's first collective for the others to notice."""
        group = self.group
        group.raise_if_aborted()
        if group.rank() != 0:
            return False
        if self.admit_at is None:
            return group.grow_requested()
        if step not in self.admit_at:
            return False
        self.admit_at.discard(step)
        deadline = time.monotonic() + self.settings.quorum_timeout_s
        while not group.grow_requested() and time.monotonic() < deadline:
            time.sleep(0.05)  # the replay's replacement is still starting
        return True

    def grow(self, before_grow: Callable[[], None] = lambda: None) -> None:
        """On every member, once they agreed to let a replacement in: end this generation
        (PeerLost). `before_grow`: what each finishes first (the generation's end would cut
        it: its part of a background save)."""
        before_grow()
        self.membership.ask_to_grow()

    def recover(
        self, applied_step: int, reason: str, save: SaveFn, load: LoadFn, sync: Sync | None = None
    ) -> Recovered:
        """Agree on the next members, connect to them, and bring everyone to one state: the
        donor's (the member that applied the most steps), or what `sync` does instead (the
        sharded stages: train/live_snapshots.py)."""
        start = time.monotonic()
        first_reason = reason
        while True:
            try:
                clock = _Phases()
                members = self.membership.next_generation(applied_step, reason)
                clock.mark("agree")
                self.group.reform(
                    self.group.generation + 1, members, self.group.member, self._connect
                )
                clock.mark("connect")
                if sync is not None:
                    return self._recovered(*sync(), start, first_reason, clock)
                return self._sync(applied_step, save, load, start, first_reason, clock)
            except PeerLost as exc:  # lost another member while forming: once more
                reason = str(exc)

    def _recovered(
        self, step: int, donor: str, received: bool, start: float, reason: str, clock: _Phases
    ) -> Recovered:
        group = self.group
        clock.mark("state")
        return Recovered(
            generation=group.generation,
            members=list(group.members),
            rank=group.rank(),
            world_size=group.size(),
            step=step,
            donor=donor,
            received=received,
            seconds=time.monotonic() - start,
            reason=reason,
            phases=clock.spent,
        )

    def finish(self, step: int) -> None:
        """Call on every member once training ended at `step`: a replacement still waiting
        exits 0 then (Membership.join)."""
        self.membership.finish(step)

    def join(self, member: str, save: SaveFn, load: LoadFn, sync: Sync | None = None) -> Recovered:
        """As replacement `member`: wait to be let in, then take the donor's state (or exit 0
        if the run finishes first)."""
        start = time.monotonic()
        generation, members = self.membership.join(member)
        clock = _Phases()  # from the moment it was let in (before: waiting to be)
        reason = "joined as a replacement"
        try:
            self.group.reform(generation, members, member, self._connect)
            clock.mark("connect")
            if sync is not None:
                return self._recovered(*sync(), start, reason, clock)
            return self._sync(-1, save, load, start, reason, clock)
        except PeerLost as exc:  # lost a member while joining: now one of the members
            return self.recover(-1, f"{reason}; then {exc}", save, load, sync)

    def _sync(
        self,
        applied_step: int,
        save: SaveFn,
        load: LoadFn,
        start: float,
        reason: str,
        clock: _Phases,
    ) -> Recovered:
        group = self.group
        steps = _all_gather_ints(group, applied_step)
        best = max(steps)
        donor = steps.index(best)
        behind = any(step != best for step in steps)
        received = False
        if behind:
            blob = _broadcast_bytes(group, _dump(save()) if group.rank() == donor else b"", donor)
            tag = _broadcast_bytes(group, self._donor_tag(blob), donor)
            if applied_step != best:
                if not hmac.compare_digest(tag, self._donor_tag(blob)):
                    raise NotAMember(
                        f"generation {group.generation}: the donor's state "
                        f"({group.members[donor]}) does not carry the run's tag; not loaded"
                    )
                load(_load(blob))
                received = True
        clock.mark("state")
        return Recovered(
            generation=group.generation,
            members=list(group.members),
            rank=group.rank(),
            world_size=group.size(),
            step=best,
            donor=group.members[donor],
            received=received,
            seconds=time.monotonic() - start,
            reason=reason,
            phases=clock.spent,
        )

    def send_state(self, state: dict[str, Any] | None, donor: int) -> dict[str, Any]:
        """`state` from group rank `donor` (the others pass None) on every member, carrying
        the run's tag (checked before it is loaded with weights_only)."""
        group = self.group
        mine = _dump(state) if state is not None and group.rank() == donor else b""
        blob = _broadcast_bytes(group, mine, donor)
        tag = _broadcast_bytes(group, self._donor_tag(blob), donor)
        if not hmac.compare_digest(tag, self._donor_tag(blob)):
            raise NotAMember(
                f"generation {group.generation}: the state from {group.members[donor]} does "
                "not carry the run's tag; not loaded"
            )
        return _load(blob)

    def _donor_tag(self, blob: bytes) -> bytes:
        gen = b"%d" % self.group.generation
        tag = self.group.key.tag(b"donor", gen, hashlib.sha256(blob).digest())
        assert len(tag) == TAG_BYTES
        return tag


class _Phases:
    """Seconds between marks, by the name of the phase each mark ends."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.spent[phase] = round(now - self._last, 4)
        self._last = now


def _all_gather_ints(group: LiveGroup, value: int) -> list[int]:
    mine = torch.tensor([value], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([out], [mine]).wait()
    return [int(t.item()) for t in out]


def _broadcast_bytes(group: LiveGroup, payload: bytes, root: int) -> bytes:
    """`payload` from group rank `root` on every member (its size first, then the bytes)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    size = torch.tensor([len(payload)], dtype=torch.int64)
    group.broadcast([size], options).wait()
    if group.rank() == root:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast([data], options).wait()
    return data.numpy().tobytes()


def _dump(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _load(blob: bytes) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(blob), weights_only=True)
    return state
