"""The Trainer's live recovery at ZeRO stages 1-3: snapshots kept by neighbours (or, under
HSDP, a shard's replicas), the rollback and the re-deal (train/live_snapshots.py says the
design; this runs it over the Trainer)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.errors import NoQuorum
from phalanx.offload import DiskOffloadPolicy
from phalanx.runtime.live import LiveGroup
from phalanx.runtime.recovery import LiveRecovery
from phalanx.runtime.wire import all_gather_json, broadcast_tensors, pass_to_next
from phalanx.train.live_snapshots import Choice, PieceFiles, Snapshot, Snapshots, choose
from phalanx.train.logging.progress_bar import StepWindow

if TYPE_CHECKING:
    from phalanx.train.trainer_setup import TrainerSetup

__all__ = ["LostShards", "ShardedLive"]

Save = Callable[[], dict[str, Any]]
PART_BYTES = 16 * 2**20
"""Under disk offload, how much of the pieces one exchange of a snapshot passes at a time."""


class LostShards(NoQuorum):
    """Two neighbours lost together (or before the first snapshot): a lost rank's pieces exist
    nowhere, so the survivors cannot go on from memory (not a PeerLost: forming the group
    again would not bring them back)."""


class ShardedLive:
    """Snapshots at step boundaries, and the state every member restores after a change."""

    def __init__(self, trainer: TrainerSetup, group: LiveGroup, recovery: LiveRecovery) -> None:
        self.trainer = trainer
        self.group = group
        self.recovery = recovery
        self.snapshots = Snapshots(trainer.args.live_snapshot_steps, files=_piece_files(trainer))
        self.ring: tuple[str, ...] = tuple(group.members)
        """The members the pieces are dealt over now (empty: a replacement not yet in)."""
        self.restored: tuple[Choice, dict[str, Any], list[dict[str, torch.Tensor]]] | None = None
        """What the last sync chose, the replicated state and every old rank's pieces."""

    # ------------------------------------------------------------ snapshots
    def maybe_snapshot(self, save: Save) -> None:
        """At a boundary every `live_snapshot_steps` steps (collective)."""
        step = self.trainer.state.global_step
        if self.snapshots.due(step) and self.snapshots.own_at((self.ring, step)) is None:
            self.snapshot(save)

    def snapshot(self, save: Save) -> None:
        """This member's pieces and replicated state now; its pieces passed to the next
        member around the ring, and the previous member's kept (collective). None while
        every piece has a replica (HSDP): older copies are let go."""
        trainer, step = self.trainer, self.trainer.state.global_step
        if all(len(slot) > 1 for slot in trainer.strategy.live_slots()):
            self.snapshots.clear()
            return
        replicated = copy.deepcopy(save())
        runlog = trainer.runlog or trainer.open_runlog()
        replicated["window"] = copy.deepcopy(runlog.run)  # this member's own, never sent
        # under disk offload the live pieces themselves: Snapshots files them, no copy between
        pieces = trainer.strategy.live_pieces(trainer.optimizer, copy=self.snapshots.files is None)
        own = Snapshot(self.ring, step, pieces, replicated)
        if len(self.ring) > 1:
            kept = self._pass_around(pieces)
            before = self.ring[(self.ring.index(self.group.member) - 1) % len(self.ring)]
            self.snapshots.add(own, Snapshot(self.ring, step, kept), before)
            # Done here means every member contributed, so every member holds the new pair
            # (each adds it before this): the previous one is needed by no one.
            dist.all_reduce(torch.zeros(1), group=self.group)
            self.snapshots.settle()
        else:
            self.snapshots.only(own)

    def _pass_around(self, pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The previous member's pieces for this one's: in one exchange, or under disk offload
        in parts of about PART_BYTES, each filed as it arrives (the same number of parts on
        every member: the most any needs), so the exchange holds one part in memory, not
        every piece three times over (measured: +161 MB at the peak for 34 MB of pieces)."""
        files = self.snapshots.files
        if files is None:
            return pass_to_next(pieces, self.group)
        nbytes = sum(t.numel() * t.element_size() for t in pieces.values())
        parts = max(all_gather_json(-(-nbytes // PART_BYTES), self.group))
        kept: dict[str, torch.Tensor] = {}
        for part in _split(pieces, max(1, parts)):
            kept.update(files.keep(pass_to_next(part, self.group)))
        return kept

    # ------------------------------------------------------------ the sync
    def sync(self, save: Save) -> tuple[int, str, bool]:
        """On the new group: choose the state, send the replicated part and every old rank's
        pieces to every member (runtime/recovery.py's `Sync`)."""
        group, me = self.group, self.group.member
        step = self.trainer.state.global_step
        mine = None  # a replacement's: it holds nothing yet
        if self.ring:
            slots = [[self.ring[r] for r in slot] for slot in self.trainer.strategy.live_slots()]
            now = {"ring": list(self.ring), "applied": step, "slots": slots}
            mine = {**self.snapshots.held(), **now}
        held = dict(zip(group.members, all_gather_json(mine, group), strict=True))
        choice = choose(held)
        if choice is None:
            raise LostShards(
                f"generation {group.generation}: the lost ranks' ZeRO pieces exist nowhere (two "
                "neighbours lost together, every replica of an HSDP shard, or a loss before "
                "the first snapshot)"
            )
        key = (choice.ring, choice.step)
        rep: dict[str, Any] | None = None
        if me == choice.replicated_from:
            own = self.snapshots.own_at(key)
            rep = own.replicated if choice.rolls_back and own is not None else save()
        source = group.members.index(choice.replicated_from)
        replicated = self.recovery.send_state(_shared(rep), source)
        bundles = [
            broadcast_tensors(
                self._pieces_of(old, provider, kept, choice), group.members.index(provider), group
            )
            for old, (provider, kept) in zip(choice.owners, choice.providers, strict=True)
        ]
        if choice.rolls_back and me in choice.ring:  # this member's own window, at that step
            own = self.snapshots.own_at(key)
            replicated["window"] = None if own is None else own.replicated.get("window")
        self.restored = (choice, replicated, bundles)
        return choice.step, choice.replicated_from, True

    def _pieces_of(
        self, old: str, provider: str, kept: bool, choice: Choice
    ) -> dict[str, torch.Tensor] | None:
        if self.group.member != provider:
            return None
        key = (choice.ring, choice.step)
        if not choice.rolls_back:
            return self.trainer.strategy.live_pieces(self.trainer.optimizer)
        found = self.snapshots.kept_at(old, key) if kept else self.snapshots.own_at(key)
        assert found is not None, "choose() picked a snapshot this member does not hold"
        return found.pieces

    # ------------------------------------------------------------ the restore
    def restore(self) -> None:
        """After the rewrap: the optimizer of the new world from every old rank's pieces, the
        run window rolled back with the rest; then a first snapshot of the new ring."""
        assert self.restored is not None
        choice, replicated, bundles = self.restored
        self.restored = None
        trainer = self.trainer
        fresh = trainer.strategy.live_restore(
            trainer.model, trainer.optimizer, bundles, replicated["groups"]
        )
        trainer.replace_optimizer(fresh)
        runlog = trainer.runlog or trainer.open_runlog()
        window = replicated.get("window")
        if choice.rolls_back:  # steps after the snapshot are trained again: their losses go
            runlog.run = window if window is not None else StepWindow(runlog.traffic().wait_s)
        self.ring = tuple(self.group.members)


def _split(pieces: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """`pieces` in `parts` groups of about equal bytes, in order (some may be empty)."""
    total = sum(t.numel() * t.element_size() for t in pieces.values())
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(parts)]
    done = 0
    for name, piece in pieces.items():
        index = min(parts - 1, done * parts // max(1, total))
        out[index][name] = piece
        done += piece.numel() * piece.element_size()
    return out


def _piece_files(trainer: TrainerSetup) -> PieceFiles | None:
    """Under disk offload, files for the snapshots' pieces beside the offloaded state."""
    policy = trainer.strategy.offload
    if not isinstance(policy, DiskOffloadPolicy):
        return None
    return PieceFiles(policy.path, trainer.world.rank)


def _shared(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The replicated state as sent: without this member's own run window."""
    if state is None:
        return None
    return {k: v for k, v in state.items() if k != "window"}
