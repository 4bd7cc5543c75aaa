"""Live recovery for sharded state (ZeRO-1/2/3): each rank's pieces covered by parity.

At zero_stage 1-3 a rank's pieces (of the optimizer state, and at stage 3 of the
parameters) exist nowhere else, so a lost rank would take them with it. Every
`live_snapshot_steps` steps, at a step boundary, each member writes what only it holds
to a file of its own (one run of bytes: `runtime/wire.py`'s layout), keeps the run's
small replicated state (counters, scheduler, data position, loss tally,
hyperparameters), and sends its bytes in `live_redundancy` = k stripes to its k
successors around the ring; each keeps the sum of the stripes it receives, 1/k of a
piece (`train/live_parity.py`; k = 1: a neighbour's whole copy). Once every member holds
the new snapshot (one small all-reduce after the exchange), each lets the previous one
go: at rest a member holds one snapshot of its own (in its file: page cache, not the
process's memory) and one parity (in memory; in a file too under disk offload); while
an exchange is under way, or after a loss cut one, also the previous ones.

After a change of members, every member says which snapshots it holds, and all
choose the same one: the newest (ring, step) at which each member of that ring is
covered, by its own snapshot or by the parities of its stripes and the others'
snapshots in them. When no member was lost (a replacement joins) the "snapshot" is
the present, taken on the spot, and nothing rolls back. Otherwise everyone rolls back
to it: at most `live_snapshot_steps` steps are trained again, on the new world, with
the data re-dealt from where that snapshot stood. Two losses among k+1 neighbours
take a piece with them: then nothing covers it, and the run falls back to a restart
from its checkpoint, saying so.

Under HSDP (zero3_shard_size) each piece has a holder in every row: a lost rank's
piece is taken from a replica, at the present step, and no snapshot is kept while
every piece has two holders. Design and costs: docs/reliability.md, "Sharded live
recovery".
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from phalanx.offload.files import OffloadFiles, read_at, write_at
from phalanx.runtime.wire import as_bytes, layout, unpack
from phalanx.train import live_parity
from phalanx.train.live_parity import Fill, from_tensor, redundancy_in

__all__ = ["Choice", "PieceFiles", "Snapshot", "Snapshots", "choose"]

KEPT = 2
"""Snapshots kept of each kind until every member holds the newest (`settle`): a loss can
cut its exchange, leaving it on some members only."""
SPARE = 2
"""Files of let-go snapshots kept for the next ones (one pair: own and parity)."""

Ring = tuple[str, ...]


Layout = list[Any]
"""[header, bytes]: where each named piece lies in a member's run of bytes (wire.layout)."""


@dataclass
class Snapshot:
    """One member's state at a step boundary, as the members of `ring` were dealt: its own
    pieces' bytes, or the parity it keeps of its predecessors' stripes."""

    ring: Ring
    step: int
    flat: Tensor
    """uint8: its own pieces' bytes (own), or the sum of its predecessors' stripes (kept)."""
    layouts: dict[str, Layout]
    """Whose bytes these are, and how they lie: the owner's (own), each contributor's (kept)."""
    stripe: int
    """Bytes of one stripe in this ring's snapshot (live_parity.stripe_bytes)."""
    replicated: dict[str, Any] = field(default_factory=dict)
    """The state every member holds alike (only in the owner's own snapshots)."""

    @property
    def key(self) -> tuple[Ring, int]:
        return self.ring, self.step


class PieceFiles:
    """Snapshot bytes kept in files (a scratch directory of this process's under `parent`),
    not in the process's memory: written and read through the file, never mapped, so they
    are the kernel's to cache, write back and drop. A file let go is kept for the next
    snapshot of its size (at most SPARE of them): no new file, no new allocation, each
    time."""

    def __init__(self, parent: str | Path, rank: int, what: str) -> None:
        self.files = OffloadFiles(parent, rank, what)
        self.spare: list[Tensor] = []
        self._writer: ThreadPoolExecutor | None = None

    def pack(self, pieces: dict[str, Tensor]) -> tuple[Layout, Tensor, Future[None]]:
        """`pieces` as one run of bytes in a file, written by a thread of this object's from
        where each lies while the caller goes on (the exchange reads the pieces meanwhile):
        wait for the future before they change."""
        header, nbytes = layout(pieces)
        flat = self.new(nbytes)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="phalanx-snapshot")
        return [header, nbytes], flat, self._writer.submit(self._write, flat, header, pieces)

    def _write(self, flat: Tensor, header: list[Any], pieces: dict[str, Tensor]) -> None:
        if not flat.numel():
            return
        with self.files.through_file(flat) as fd:
            for (_, _, _, offset), piece in zip(header, pieces.values(), strict=True):
                write_at(fd, as_bytes(piece), offset)

    def reader(self, flat: Tensor) -> Fill:
        """A `Fill` over `flat`: through its file where it is in one (its pages stay out of
        this process's memory), else from memory."""
        if not self.files.holds(flat):
            return from_tensor(flat)

        def fill(offset: int, out: Tensor) -> None:
            with self.files.through_file(flat) as fd:
                got = read_at(fd, out, offset) if offset < flat.numel() else 0
            out[got:].zero_()

        return fill

    def new(self, nbytes: int) -> Tensor:
        """A file of `nbytes`: a spare one of that size if there is one."""
        same = next((i for i, t in enumerate(self.spare) if t.numel() == nbytes), None)
        if same is not None:
            return self.spare.pop(same)
        return self.files.tensor((nbytes,), torch.uint8)

    def written(self, flat: Tensor) -> None:
        """Done writing `flat` through its mapping (a parity): its pages leave this process."""
        self.files.forget([flat])

    def let_go(self, flat: Tensor) -> None:
        """`flat`'s snapshot is gone: its file is kept spare (the oldest spare removed)."""
        self.spare.append(flat)
        if len(self.spare) > SPARE:
            self.files.remove([self.spare.pop(0)])

    def holds(self, flat: Tensor) -> bool:
        return self.files.holds(flat)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.spare = []
        self.files.close()


@dataclass
class Snapshots:
    """This member's own snapshots and the parities it keeps for its predecessors, newest
    last."""

    every: int
    files: PieceFiles
    """Where the own snapshots' bytes are kept (and the parities', under disk offload)."""
    parity_in_files: bool = False
    own: list[Snapshot] = field(default_factory=list)
    kept: list[Snapshot] = field(default_factory=list)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def new_parity(self, nbytes: int) -> Tensor:
        """Room for a parity of `nbytes`: in a file under disk offload, else in memory."""
        if self.parity_in_files:
            return self.files.new(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def add(self, own: Snapshot, kept: Snapshot) -> None:
        """A new pair, written: the older ones stay until `settle`."""
        if self.files.holds(kept.flat):  # filled through its mapping by the exchange
            self.files.written(kept.flat)
        mine = [*[s for s in self.own if s.key != own.key][-(KEPT - 1) :], own]
        older = [s for s in self.kept if s.key != kept.key][-(KEPT - 1) :]
        self._keep(mine, [*older, kept])

    def only(self, own: Snapshot) -> None:
        """A ring of one: this member's own snapshot, nothing kept for anyone."""
        self._keep([own], [])

    def settle(self) -> None:
        """Every member holds the newest pair (own and kept): the older ones go."""
        self._keep(self.own[-1:], self.kept[-1:])

    def clear(self) -> None:
        self._keep([], [])

    def close(self) -> None:
        """The run is over: every snapshot goes, and their files' directory."""
        self.clear()
        self.files.close()

    def _keep(self, own: list[Snapshot], kept: list[Snapshot]) -> None:
        """These snapshots from now on; the files of any other go."""
        staying = {id(s) for s in [*own, *kept]}
        for snapshot in [*self.own, *self.kept]:
            if id(snapshot) not in staying and self.files.holds(snapshot.flat):
                self.files.let_go(snapshot.flat)
        self.own, self.kept = own, kept

    def nbytes(self, in_files: bool | None = None) -> int:
        """Bytes of snapshots held (`in_files`: only those in files, or only those not)."""
        flats = [s.flat for s in [*self.own, *self.kept]]
        if in_files is not None:
            flats = [t for t in flats if self.files.holds(t) == in_files]
        return sum(t.numel() for t in flats)

    def held(self) -> dict[str, Any]:
        """What this member can provide, for `choose` (JSON)."""
        return {
            "own": [[list(s.ring), s.step] for s in self.own],
            "kept": [[list(s.ring), s.step] for s in self.kept],
        }

    def pieces(self, own: Snapshot, member: str) -> dict[str, Tensor]:
        """The named pieces of `member`'s own snapshot, read back (copies)."""
        header, nbytes = own.layouts[member]
        flat = torch.empty(int(nbytes), dtype=torch.uint8)
        self.files.reader(own.flat)(0, flat)
        return unpack(header, flat)

    def own_at(self, key: tuple[Ring, int]) -> Snapshot | None:
        return next((s for s in self.own if s.key == key), None)

    def kept_at(self, key: tuple[Ring, int]) -> Snapshot | None:
        return next((s for s in self.kept if s.key == key), None)


@dataclass(frozen=True)
class Choice:
    """The snapshot every member restores from, and who provides each old piece."""

    ring: Ring
    step: int
    providers: list[tuple[str, bool]]
    """For each piece of the sharded state, in order: who provides it, and whether it is
    rebuilt from parity (True: every member takes part; this one says its layout) or
    sent from its own snapshot or state (False)."""
    owners: Ring
    """For each piece, the member whose it was."""
    replicated_from: str
    """A member holding the replicated state at `step` (its own snapshot)."""
    rolls_back: bool
    redundancy: int = 0
    """The k of the chosen ring's parity (live_parity.redundancy_in)."""


def choose(held: Mapping[str, dict[str, Any] | None]) -> Choice | None:
    """The newest snapshot every member of its ring is covered at (None: none is).

    `held`: each new member's `Snapshots.held()` with the ring its pieces are dealt over now,
    who holds each piece ("slots": one list of members per piece; each member alone by
    default, under HSDP a piece's replicas), the step it applied ("ring", "applied") and
    the run's live_redundancy ("redundancy"), or None for a replacement, which holds
    nothing. When every piece has a holder here and all applied the same step, the
    present is the snapshot: a holder of each piece provides it on the spot, and nothing
    rolls back.
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
    asked = {int(info.get("redundancy", 1)) for info in held.values() if info is not None}
    for key in sorted(candidates, key=lambda key: -key[1]):
        k = redundancy_in(len(key[0]), max(asked, default=1))
        providers = _providers(held, *key, k)
        if providers is not None:
            source = next(m for m, rebuilt in providers if not rebuilt)
            return Choice(key[0], key[1], providers, key[0], source, True, k)
    return None


def _now(info: dict[str, Any]) -> tuple[Ring, int, tuple[Ring, ...]]:
    ring = tuple(info["ring"])
    slots = info.get("slots") or [[member] for member in ring]
    return ring, int(info["applied"]), tuple(tuple(slot) for slot in slots)


def _providers(
    held: Mapping[str, dict[str, Any] | None], ring: Ring, step: int, k: int
) -> list[tuple[str, bool]] | None:
    """Each member of `ring` covered at `step`: by its own snapshot, or rebuilt from the
    parities of its stripes (every holder here with it, and every other contributor with
    its own snapshot)."""

    def has(member: str, what: str) -> bool:
        info = held.get(member)
        return info is not None and [list(ring), step] in info[what]

    out = []
    n = len(ring)
    for i, member in enumerate(ring):
        if has(member, "own"):
            out.append((member, False))
            continue
        keepers = [ring[h] for h in live_parity.holders(i, n, k)]
        others = [ring[c] for c in live_parity.needed(i, n, k)]
        if k < 1 or not all(has(m, "kept") for m in keepers):
            return None
        if not all(has(m, "own") for m in others):
            return None
        out.append((keepers[0], True))
    return out
