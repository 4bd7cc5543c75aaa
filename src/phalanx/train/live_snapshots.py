"""Live recovery for sharded state (ZeRO-1/2): each rank's pieces kept by its neighbour.

At zero_stage 1 and 2 a rank's optimizer pieces exist nowhere else, so a lost
rank would take them with it. Every `live_snapshot_steps` steps, at a step
boundary, each member copies what only it holds (its pieces of the parameters
and of the optimizer state) and the run's small replicated state (counters,
scheduler, data position, loss tally, hyperparameters) into host memory, and
passes its pieces to the next member around the ring, which keeps them. Once
every member holds the new pair (one small all-reduce after the exchange), each
lets the previous pair go: at rest a member holds one snapshot of its own and
one of its predecessor's; while an exchange is under way, or after a loss cut
one, also the previous pair.

After a change of members, every member says which snapshots it holds, and all
choose the same one: the newest (ring, step) for which each member of that ring
is covered, by itself or by the member that kept its pieces. When no member
was lost (a replacement joins) the "snapshot" is the present, taken on the
spot, and nothing rolls back. Otherwise everyone rolls back to it: at most
`live_snapshot_steps` steps are trained again, on the new world, with the
data re-dealt from where that snapshot stood. Two neighbours lost together
take a ring's pieces with them: then nothing covers them, and the run falls
back to a restart from its checkpoint, saying so.

Under HSDP (zero3_shard_size) each piece has a holder in every row: a lost rank's
piece is taken from a replica, at the present step, and no snapshot is kept while
every piece has two holders. Design and costs: docs/reliability.md, "Sharded live
recovery".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["Choice", "Snapshot", "Snapshots", "choose"]

KEPT = 2
"""Snapshots kept per owner until every member holds the newest (`settle`): a loss can cut
its exchange, leaving it on some members only."""

Ring = tuple[str, ...]


@dataclass
class Snapshot:
    """One member's state at a step boundary, as the members of `ring` were dealt."""

    ring: Ring
    step: int
    pieces: dict[str, Tensor]
    """What only its owner held (ZeRO's pieces): parameters and optimizer state."""
    replicated: dict[str, Any] = field(default_factory=dict)
    """The state every member holds alike (only in the owner's own snapshots)."""

    @property
    def key(self) -> tuple[Ring, int]:
        return self.ring, self.step


@dataclass
class Snapshots:
    """This member's own snapshots and the ones it keeps for its predecessor, newest last."""

    every: int
    own: list[Snapshot] = field(default_factory=list)
    kept: list[tuple[str, Snapshot]] = field(default_factory=list)
    """(whose, snapshot): the previous member's pieces around each snapshot's ring."""

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def add(self, own: Snapshot, kept: Snapshot, kept_from: str) -> None:
        self.own = [*[s for s in self.own if s.key != own.key][-(KEPT - 1) :], own]
        older = [(m, s) for m, s in self.kept if s.key != kept.key][-(KEPT - 1) :]
        self.kept = [*older, (kept_from, kept)]

    def settle(self) -> None:
        """Every member holds the newest pair (own and kept): the older ones go."""
        self.own, self.kept = self.own[-1:], self.kept[-1:]

    def held(self) -> dict[str, Any]:
        """What this member can provide, for `choose` (JSON)."""
        return {
            "own": [[list(s.ring), s.step] for s in self.own],
            "kept": [[m, list(s.ring), s.step] for m, s in self.kept],
        }

    def own_at(self, key: tuple[Ring, int]) -> Snapshot | None:
        return next((s for s in self.own if s.key == key), None)

    def kept_at(self, whose: str, key: tuple[Ring, int]) -> Snapshot | None:
        return next((s for m, s in self.kept if m == whose and s.key == key), None)


@dataclass(frozen=True)
class Choice:
    """The snapshot every member restores from, and who provides each old piece."""

    ring: Ring
    step: int
    providers: list[tuple[str, bool]]
    """For each piece of the sharded state, in order: who provides it, and whether from
    what it kept (True) or from its own snapshot or state (False)."""
    owners: Ring
    """For each piece, the member whose it was (its provider's ring neighbour, if kept)."""
    replicated_from: str
    """A member holding the replicated state at `step` (its own snapshot)."""
    rolls_back: bool


def choose(held: Mapping[str, dict[str, Any] | None]) -> Choice | None:
    """The newest snapshot every member of its ring is covered at (None: none is).

    `held`: each new member's `Snapshots.held()` with the ring its pieces are dealt over now,
    who holds each piece ("slots": one list of members per piece; each member alone by
    default, under HSDP a piece's replicas) and the step it applied ("ring", "applied"),
    or None for a replacement, which holds nothing. When every piece has a holder here
    and all applied the same step, the present is the snapshot: a holder of each piece
    provides it on the spot, and nothing rolls back.
    """
    nows = {_now(info) for info in held.values() if info is not None}
    if len(nows) == 1:
        ring, step, slots = nows.pop()
        holders = [next((m for m in slot if held.get(m) is not None), None) for slot in slots]
        present = [m for m in holders if m is not None]
        if ring and len(present) == len(slots):
            return Choice(
                ring, step, [(m, False) for m in present], tuple(present), present[0], False
            )
    candidates = {
        (tuple(r), s) for info in held.values() if info is not None for r, s in info["own"]
    }
    for key in sorted(candidates, key=lambda key: -key[1]):
        providers = _providers(held, *key)
        if providers is not None:
            source = next(m for m, from_kept in providers if not from_kept)
            return Choice(key[0], key[1], providers, key[0], source, rolls_back=True)
    return None


def _now(info: dict[str, Any]) -> tuple[Ring, int, tuple[Ring, ...]]:
    ring = tuple(info["ring"])
    slots = info.get("slots") or [[member] for member in ring]
    return ring, int(info["applied"]), tuple(tuple(slot) for slot in slots)


def _providers(
    held: Mapping[str, dict[str, Any] | None], ring: Ring, step: int
) -> list[tuple[str, bool]] | None:
    out = []
    for i, member in enumerate(ring):
        mine, keeper = held.get(member), ring[(i + 1) % len(ring)]
        theirs = held.get(keeper)
        if mine is not None and [list(ring), step] in mine["own"]:
            out.append((member, False))
        elif theirs is not None and [member, list(ring), step] in theirs["kept"]:
            out.append((keeper, True))
        else:
            return None
    return out
