"""The Trainer's live recovery at ZeRO stages 1-3: snapshots covered by parity over the
next members (or, under HSDP, a shard's replicas), the rollback and the re-deal
(train/live_snapshots.py says the design; this runs it over the Trainer)."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.errors import NoQuorum
from phalanx.offload import DiskOffloadPolicy
from phalanx.optim.zero_state import Assembly
from phalanx.runtime.live import LiveGroup
from phalanx.runtime.recovery import LiveRecovery
from phalanx.runtime.wire import (
    all_gather_json,
    all_to_all_tensors,
    broadcast_json,
    broadcast_tensors,
    unpack,
)
from phalanx.train.live_parity import (
    contribution,
    exchange,
    from_pieces,
    redundancy_in,
    stripe_bytes,
)
from phalanx.train.live_snapshots import Choice, PieceFiles, Snapshot, Snapshots, choose
from phalanx.train.logging.progress_bar import StepWindow

if TYPE_CHECKING:
    from phalanx.train.trainer_setup import TrainerSetup

__all__ = ["LostShards", "ShardedLive"]

Save = Callable[[], dict[str, Any]]
PART_BYTES = 16 * 2**20
"""How many bytes one member sends (and receives) at a time in a snapshot's exchange."""


class LostShards(NoQuorum):
    """Two losses among live_redundancy + 1 neighbours (or one before the first snapshot): a
    lost rank's pieces exist nowhere, so the survivors cannot go on from memory (not a
    PeerLost: forming the group again would not bring them back)."""


class ShardedLive:
    """Snapshots at step boundaries, and the state every member restores after a change."""

    def __init__(self, trainer: TrainerSetup, group: LiveGroup, recovery: LiveRecovery) -> None:
        self.trainer = trainer
        self.group = group
        self.recovery = recovery
        files, parity_in_files = _piece_files(trainer)
        self.snapshots = Snapshots(trainer.args.live_snapshot_steps, files, parity_in_files)
        self.redundancy = trainer.args.live_redundancy
        """k: each member's pieces covered by parity over its next k members (live_parity)."""
        self.ring: tuple[str, ...] = tuple(group.members)
        """The members the pieces are dealt over now (empty: a replacement not yet in)."""
        self.restored: tuple[Choice, dict[str, Any], Assembly] | None = None
        """What the last sync chose, the replicated state, and what this member kept of every
        old rank's pieces."""

    # ------------------------------------------------------------ snapshots
    def maybe_snapshot(self, save: Save) -> None:
        """At a boundary every `live_snapshot_steps` steps (collective)."""
        step = self.trainer.state.global_step
        if self.snapshots.due(step) and self.snapshots.own_at((self.ring, step)) is None:
            self.snapshot(save)

    def snapshot(self, save: Save) -> None:
        """This member's pieces and replicated state now, its pieces' bytes in a file, and
        their parity passed to the next `live_redundancy` members around the ring, the
        parity of the previous members' kept (collective). None while every piece has a
        replica (HSDP): older copies are let go."""
        trainer, step, member = self.trainer, self.trainer.state.global_step, self.group.member
        if all(len(slot) > 1 for slot in trainer.strategy.live_slots()):
            self.snapshots.clear()
            return
        replicated = copy.deepcopy(save())
        runlog = trainer.runlog or trainer.open_runlog()
        replicated["window"] = copy.deepcopy(runlog.run)  # this member's own, never sent
        # the live pieces themselves: their bytes go to the file with no copy between,
        # written by a thread while the exchange reads them
        pieces = trainer.strategy.live_pieces(trainer.optimizer, copy=False)
        mine, flat, writing = self.snapshots.files.pack(pieces)
        own = Snapshot(self.ring, step, flat, {member: mine}, 0, replicated)
        try:
            kept = self._parity(own, pieces) if len(self.ring) > 1 else None
            writing.result()
        except BaseException:
            writing.exception()  # the pieces stay as they are until the file is written
            self.snapshots.files.let_go(flat)
            raise
        if kept is None:
            self.snapshots.only(own)
            return
        self.snapshots.add(own, kept)
        # Done here means every member contributed, so every member holds the new pair
        # (each adds it before this): the previous one is needed by no one.
        dist.all_reduce(torch.zeros(1), group=self.group)
        self.snapshots.settle()

    def _parity(self, own: Snapshot, pieces: dict[str, torch.Tensor]) -> Snapshot:
        """The parity this member keeps of its predecessors' stripes, while it sends its own
        (collective: every member's layout, then the exchange); `own.stripe` set."""
        assert self.ring == tuple(self.group.members), "a snapshot over a ring not formed"
        n, k = len(self.ring), redundancy_in(len(self.ring), self.redundancy)
        mine = own.layouts[self.group.member]
        every = all_gather_json(mine, self.group)
        own.stripe = stripe_bytes(max(int(nbytes) for _, nbytes in every), k)
        parity = self.snapshots.new_parity(own.stripe)
        try:
            exchange(from_pieces(mine[0], pieces), own.stripe, k, parity, self.group, PART_BYTES)
        except BaseException:
            if self.snapshots.files.holds(parity):
                self.snapshots.files.let_go(parity)
            raise
        me = self.ring.index(self.group.member)
        layouts = {self.ring[(me - j) % n]: every[(me - j) % n] for j in range(1, k + 1)}
        return Snapshot(self.ring, own.step, parity, layouts, own.stripe)

    # ------------------------------------------------------------ the sync
    def sync(self, save: Save) -> tuple[int, str, bool]:
        """On the new group: choose the state, send the replicated part and every old rank's
        pieces to every member (runtime/recovery.py's `Sync`)."""
        group, me = self.group, self.group.member
        step = self.trainer.state.global_step
        mine = None  # a replacement's: it holds nothing yet
        if self.ring:
            slots = [[self.ring[r] for r in slot] for slot in self.trainer.strategy.live_slots()]
            now = {
                "ring": list(self.ring),
                "applied": step,
                "slots": slots,
                "redundancy": self.redundancy,
            }
            mine = {**self.snapshots.held(), **now}
        held = dict(zip(group.members, all_gather_json(mine, group), strict=True))
        choice = choose(held)
        if choice is None:
            raise LostShards(
                f"generation {group.generation}: the lost ranks' ZeRO pieces exist nowhere (two "
                f"of {self.redundancy + 1} neighbouring ranks lost together, every replica of "
                "an HSDP shard, or a loss before the first snapshot)"
            )
        key = (choice.ring, choice.step)
        rep: dict[str, Any] | None = None
        if me == choice.replicated_from:
            own = self.snapshots.own_at(key)
            rep = own.replicated if choice.rolls_back and own is not None else save()
        source = group.members.index(choice.replicated_from)
        replicated = self.recovery.send_state(_shared(rep), source)
        assembly = self._layout(group.rank(), group.size())
        if assembly.rows_only:
            self._deal_rows(choice, assembly)
        else:
            self._deal_wholes(choice, assembly)
        if choice.rolls_back and me in choice.ring:  # this member's own window, at that step
            own = self.snapshots.own_at(key)
            replicated["window"] = None if own is None else own.replicated.get("window")
        self.restored = (choice, replicated, assembly)
        return choice.step, choice.replicated_from, True

    def _layout(self, rank: int, world_size: int) -> Assembly:
        """What rank `rank` of `world_size` holds of each sharded tensor (the strategy's
        layout), as the Assembly that keeps it."""
        trainer = self.trainer
        return trainer.strategy.live_assembly(trainer.optimizer, rank, world_size)

    def _deal_wholes(self, choice: Choice, assembly: Assembly) -> None:
        """Every old rank's pieces to every member, one old rank at a time, in order (the
        parameters are replicated at stages 1-2, so every member needs them whole)."""
        group = self.group
        for old, (provider, rebuilt) in zip(choice.owners, choice.providers, strict=True):
            assembly.add(
                self._rebuilt(old, provider, choice)
                if rebuilt
                else broadcast_tensors(
                    self._pieces_of(provider, choice), group.members.index(provider), group
                )
            )

    def _deal_rows(self, choice: Choice, assembly: Assembly) -> None:
        """Each member's new rows (`deal_rows`): the survivors' from them, a lost rank's
        from its rebuilt pieces."""
        me = self.group.member
        mine = {}
        for j, (provider, is_rebuilt) in enumerate(choice.providers):
            if provider == me and not is_rebuilt:
                pieces = self._pieces_of(provider, choice)
                assert pieces is not None
                mine[j] = pieces
        rebuilt = [j for j, (_, is_rebuilt) in enumerate(choice.providers) if is_rebuilt]

        def rebuild(j: int) -> dict[str, torch.Tensor]:
            return self._rebuilt(choice.owners[j], choice.providers[j][0], choice)

        deal_rows(assembly, self._layout, len(choice.owners), mine, rebuilt, rebuild, self.group)

    def _pieces_of(self, provider: str, choice: Choice) -> dict[str, torch.Tensor] | None:
        """`provider`'s own pieces at the chosen step, on `provider` (None elsewhere)."""
        if self.group.member != provider:
            return None
        if not choice.rolls_back:  # the live ones: what leaves is packed (copied) on its way
            return self.trainer.strategy.live_pieces(self.trainer.optimizer, copy=False)
        found = self.snapshots.own_at((choice.ring, choice.step))
        assert found is not None, "choose() picked a snapshot this member does not hold"
        return self.snapshots.pieces(found, provider)

    def _rebuilt(self, old: str, provider: str, choice: Choice) -> dict[str, torch.Tensor]:
        """A lost member's pieces at the chosen step, from the parities of its stripes less
        the other contributors' stripes, summed on every member at once (collective;
        `provider`, the first holder of its parity, says how they lie)."""
        key, me, group = (choice.ring, choice.step), self.group.member, self.group
        kept, own = self.snapshots.kept_at(key), self.snapshots.own_at(key)
        said = None
        if me == provider:
            assert kept is not None, "choose() picked a parity this member does not hold"
            said = [*kept.layouts[old], kept.stripe]
        header, nbytes, stripe = broadcast_json(said, group.members.index(provider), group)
        index = choice.ring.index(me) if me in choice.ring else None
        found = contribution(
            choice.ring.index(old),
            index,
            len(choice.ring),
            choice.redundancy,
            int(stripe),
            None if own is None else self.snapshots.files.reader(own.flat),
            None if kept is None else kept.flat,
        )
        dist.all_reduce(found, group=group)
        return unpack(header, found[: int(nbytes)])

    # ------------------------------------------------------------ the restore
    def restore(self) -> None:
        """After the rewrap: the optimizer of the new world from every old rank's pieces, the
        run window rolled back with the rest; then a first snapshot of the new ring."""
        assert self.restored is not None
        choice, replicated, assembly = self.restored
        self.restored = None
        trainer = self.trainer
        fresh = trainer.strategy.live_restore(
            trainer.model, trainer.optimizer, assembly, replicated["groups"]
        )
        trainer.replace_optimizer(fresh)
        runlog = trainer.runlog or trainer.open_runlog()
        window = replicated.get("window")
        if choice.rolls_back:  # steps after the snapshot are trained again: their losses go
            runlog.run = window if window is not None else StepWindow(runlog.traffic().wait_s)
        self.ring = tuple(self.group.members)


def _piece_files(trainer: TrainerSetup) -> tuple[PieceFiles, bool]:
    """Files for the snapshots' bytes: beside the offloaded state under disk offload (the
    parities there too, True), else in the temporary directory (TMPDIR)."""
    policy = trainer.strategy.offload
    if isinstance(policy, DiskOffloadPolicy):
        return PieceFiles(policy.path, trainer.world.rank, "zero_offload_dir"), True
    return PieceFiles(tempfile.gettempdir(), trainer.world.rank, "TMPDIR"), False


def deal_rows(
    assembly: Assembly,
    layout: Callable[[int, int], Assembly],
    n_old: int,
    mine: dict[int, dict[str, torch.Tensor]],
    rebuilt: list[int],
    rebuild: Callable[[int], dict[str, torch.Tensor]],
    group: dist.ProcessGroup,
) -> None:
    """Into `assembly`, this member's rows of the new world (`layout(rank, world_size)`),
    from the pieces of `n_old` old ranks: those this member holds (`mine`, by old rank)
    reach each member in one all-to-all, each pair sending only the rows meant for it;
    those of the `rebuilt` old ranks come whole from `rebuild(j)` (a collective, called on
    every member in old-rank order). No member receives more than its new rows, besides a
    lost rank's pieces."""
    size = dist.get_world_size(group)
    wanted = [layout(r, size).wanted for r in range(size)]
    old_rows = [layout(j, n_old).wanted for j in range(n_old)]
    outgoing: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for j, pieces in mine.items():
        held = old_rows[j]
        for name, value in pieces.items():
            if value.dim() == 0:  # a scalar ("step"): the same everywhere, sent whole
                for part in outgoing:
                    part[f"{j}/{name}"] = value
                continue
            start, stop = held(assembly.shape_of(name))
            flat = value.reshape(-1)
            for r, part in enumerate(outgoing):
                lo, hi = _overlap((start, stop), wanted[r](assembly.shape_of(name)))
                # empty where they do not meet: the name and dtype still arrive (a rank
                # with no rows of a tensor holds its empty state all the same)
                lo = min(max(lo, start), stop)
                part[f"{j}/{name}"] = flat[lo - start : max(lo, hi) - start]
    received: dict[int, dict[str, torch.Tensor]] = {}
    for parts in all_to_all_tensors(outgoing, group):
        for key, value in parts.items():
            old_rank, name = key.split("/", 1)
            received.setdefault(int(old_rank), {})[name] = value
    del outgoing
    here = wanted[dist.get_rank(group)]
    for j, held in enumerate(old_rows):
        whole_pieces = j in rebuilt
        bundle = rebuild(j) if whole_pieces else received.pop(j, {})
        starts = {
            name: (
                held(assembly.shape_of(name))
                if whole_pieces
                else _overlap(held(assembly.shape_of(name)), here(assembly.shape_of(name)))
            )[0]
            for name, value in bundle.items()
            if value.dim()
        }
        assembly.add(bundle, starts)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _shared(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The replicated state as sent: without this member's own run window."""
    if state is None:
        return None
    return {k: v for k, v in state.items() if k != "window"}
