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

Under disk offload the snapshots' pieces go to files of their own beside the
offloaded state (`PieceFiles`), unmapped once written: a run that offloads
because its state does not fit in memory does not hold two more copies of its
part there.

Under HSDP (zero3_shard_size) each piece has a holder in every row: a lost rank's
piece is taken from a replica, at the present step, and no snapshot is kept while
every piece has two holders. Design and costs: docs/reliability.md, "Sharded live
recovery".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from phalanx.offload.files import OffloadFiles

__all__ = ["Choice", "PieceFiles", "Snapshot", "Snapshots", "choose"]

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


class PieceFiles:
    """Snapshot pieces kept in files (a scratch directory of this process's under
    zero_offload_dir), not in host memory: written through the page cache and unmapped at
    once, so they are the kernel's to write back and to drop, and read back from there
    only by a rollback."""

    def __init__(self, parent: str | Path, rank: int) -> None:
        self.files = OffloadFiles(parent, rank, "zero_offload_dir")

    def keep(self, pieces: dict[str, Tensor]) -> dict[str, Tensor]:
        """`pieces` in files of their own (those already in them as they are), one at a time:
        a live tensor is copied straight from where it lies."""
        kept = {}
        for name, piece in pieces.items():
            if self.files.holds(piece):
                kept[name] = piece
                continue
            kept[name] = self.files.copy(piece)
            self.files.forget([kept[name]])
        return kept

    def let_go(self, pieces: dict[str, Tensor]) -> None:
        self.files.remove(list(pieces.values()))

    def holds(self, piece: Tensor) -> bool:
        return self.files.holds(piece)

    def close(self) -> None:
        self.files.close()


@dataclass
class Snapshots:
    """This member's own snapshots and the ones it keeps for its predecessor, newest last."""

    every: int
    own: list[Snapshot] = field(default_factory=list)
    kept: list[tuple[str, Snapshot]] = field(default_factory=list)
    """(whose, snapshot): the previous member's pieces around each snapshot's ring."""
    files: PieceFiles | None = None
    """Where the pieces are kept under disk offload (None: in host memory)."""

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def add(self, own: Snapshot, kept: Snapshot, kept_from: str) -> None:
        own, kept = self._stored(own), self._stored(kept)
        mine = [*[s for s in self.own if s.key != own.key][-(KEPT - 1) :], own]
        older = [(m, s) for m, s in self.kept if s.key != kept.key][-(KEPT - 1) :]
        self._keep(mine, [*older, (kept_from, kept)])

    def only(self, own: Snapshot) -> None:
        """A ring of one: this member's own snapshot, nothing kept for anyone."""
        self._keep([self._stored(own)], [])

    def settle(self) -> None:
        """Every member holds the newest pair (own and kept): the older ones go."""
        self._keep(self.own[-1:], self.kept[-1:])

    def clear(self) -> None:
        self._keep([], [])

    def close(self) -> None:
        """The run is over: every snapshot goes, and their files' directory."""
        self.clear()
        if self.files is not None:
            self.files.close()

    def _stored(self, snapshot: Snapshot) -> Snapshot:
        if self.files is not None:
            snapshot.pieces = self.files.keep(snapshot.pieces)
        return snapshot

    def _keep(self, own: list[Snapshot], kept: list[tuple[str, Snapshot]]) -> None:
        """These snapshots from now on; the files of any other go."""
        if self.files is not None:
            staying = {id(s) for s in own} | {id(s) for _, s in kept}
            for snapshot in [*self.own, *(s for _, s in self.kept)]:
                if id(snapshot) not in staying:
                    self.files.let_go(snapshot.pieces)
        self.own, self.kept = own, kept

    def nbytes(self, in_files: bool | None = None) -> int:
        """Bytes of pieces held (`in_files`: only those in files, or only those not)."""
        pieces = [t for s in [*self.own, *(k for _, k in self.kept)] for t in s.pieces.values()]
        if in_files is not None:
            held = self.files.holds if self.files is not None else (lambda _: False)
            pieces = [t for t in pieces if held(t) == in_files]
        return sum(t.numel() * t.element_size() for t in pieces)

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
