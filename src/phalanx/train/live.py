"""The Trainer under `fault_tolerance="live"`: a lost rank costs the step in flight, not a
restart from disk (runtime/recovery.py has the protocol, docs/reliability.md the design).

After the members agree, every one of them rebuilds what depends on the world in
the same order: the `World` its parts hold, phalanx DDP over the new group, and
the sampler, which deals the rest of the epoch over the new world from the
samples every rank had used (`DistributedSampler.reshard`). A replacement builds
its Trainer as a world of one, then joins, takes the donor's state and rebuilds
the same way; so both arrive at the loop's next step with the same collectives.
The per-rank batch stays as configured: after a loss each step averages fewer
samples (same learning rate, more gradient noise), and an epoch takes more steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from phalanx.errors import ConfigurationError, PeerLost
from phalanx.ground.progress_record import PROGRESS_DIR_VAR
from phalanx.ground.safe_files import open_append
from phalanx.ground.store_keys import RESTART_MARK
from phalanx.runtime.live import LiveGroup, current_live_group
from phalanx.runtime.membership import settings_from_env
from phalanx.runtime.recovery import LiveRecovery, Recovered, Sync
from phalanx.train.checkpoint.stateful import Stateful
from phalanx.train.live_sharded import LostShards, ShardedLive

if TYPE_CHECKING:
    from phalanx.train.trainer_setup import TrainerSetup

__all__ = ["LiveTraining", "live_training_for"]

MEMBERSHIP_LOG = "live_membership.jsonl"
"""In output_dir: one line per change of members (generation, step, members, donor, why)."""
REPLAY_ENV = "PHALANX_LIVE_REPLAY"
"""A membership log to replay: replacements are let in at the steps it records."""

_TRANSFERRED = ("trainer", "model", "optimizer", "scheduler", "comm", "scaler")
"""The checkpoint entries a donor sends (not "rng": each member reseeds, below; not the
data position: sent as the samples all ranks used)."""
_SHARDED = ("model", "optimizer")
"""What ZeRO-1/2 send as pieces instead (the parameters and the optimizer state)."""


def live_training_for(trainer: TrainerSetup) -> LiveTraining | None:
    """The run's live recovery, or None; refuses what it cannot keep, in one line."""
    args = trainer.args
    if args.fault_tolerance != "live" or trainer.train_dataset is None:
        return None
    group = current_live_group()
    if group is None:
        raise ConfigurationError(
            'fault_tolerance="live" needs the live group of `phalanx launch --live-recovery` '
            "— launch with it, or leave fault_tolerance at its default"
        )
    if trainer.stream is not None or trainer.sampler is None:
        raise ConfigurationError(
            'fault_tolerance="live" deals a map-style train_dataset over the survivors; a '
            "stream cannot be re-dealt mid-epoch — use a dataset with a length, or "
            'fault_tolerance="restart"'
        )
    return LiveTraining(trainer, group)


class LiveTraining:
    """The Trainer's side of live recovery (module docstring)."""

    def __init__(self, trainer: TrainerSetup, group: LiveGroup) -> None:
        self.trainer = trainer
        if trainer.periodic_sync is not None:  # synced by the loop once a step is counted
            trainer.periodic_sync.deferred = True
        self.group = group
        self.recovery = LiveRecovery(group, settings_from_env(), replayed_admissions())
        self.log_path = Path(trainer.args.output_dir) / MEMBERSHIP_LOG
        """Rank 0's record of every change of members (what REPLAY_ENV replays)."""
        self._data: dict[str, int] | None = None
        """The donor's data position, when this member took the donor's state."""
        self.sharded = (
            ShardedLive(trainer, group, self.recovery) if trainer.strategy.shards_state else None
        )
        """ZeRO-1/2: each rank's pieces kept by its neighbour, and the rollback to them."""

    @property
    def is_replacement(self) -> bool:
        """A replacement not yet in the run (its Trainer was built as a world of one)."""
        return self.group.generation < 0

    def boundary(self) -> bool:
        """Between steps: PeerLost if the generation ended; a snapshot when one is due;
        whether this member (rank 0) lets a waiting replacement in (the boundary vote
        carries it to every member, which then `grow`s)."""
        wants = self.recovery.wants_grow(self.trainer.state.global_step)
        if self.sharded is not None:
            self.sharded.maybe_snapshot(self._save)
        return wants

    def grow(self) -> None:
        """Every member, at the boundary they agreed on: let the replacement in (PeerLost);
        each member's part of a save in flight is written first."""
        self.recovery.grow(self.trainer.checkpointer.background.wait_written)

    def finish(self) -> None:
        """Training ended: a replacement still starting need not join (it exits 0); the
        snapshots go."""
        self.recovery.finish(self.trainer.state.global_step)
        if self.sharded is not None:
            self.sharded.snapshots.close()

    def recover(self, lost: PeerLost) -> None:
        """Drop the step in flight, agree on the members, take the donor's state, rebuild;
        a loss during the rebuild (its broadcasts) is one more recovery, not the run's end."""
        trainer = self.trainer
        while True:
            trainer.optimizer.zero_grad(set_to_none=True)
            step = trainer.state.global_step
            try:
                done = self.recovery.recover(step, str(lost), self._save, self._load, self._sync)
                self._rebuild(done)
                return
            except LostShards as gone:
                raise self._cannot_go_on(gone) from gone
            except PeerLost as again:
                lost = again

    def join(self) -> None:
        done = self.recovery.join(self.group.member, self._save, self._load, self._sync)
        try:
            self._rebuild(done)
        except PeerLost as lost:
            self.recover(lost)

    @property
    def _sync(self) -> Sync | None:
        """The sharded stages' sync (rollback and re-deal), then their replicated state loaded
        on every member; None: the donor's (stage 0)."""
        sharded = self.sharded
        if sharded is None:
            return None

        def sync() -> tuple[int, str, bool]:
            result = sharded.sync(self._save)
            assert sharded.restored is not None
            self._load(sharded.restored[1])
            return result

        return sync

    def _cannot_go_on(self, gone: LostShards) -> LostShards:
        fall_back_to_restart()  # the launcher restarts every rank from the checkpoint
        return LostShards(
            f"{gone} — the run restarts from its last checkpoint (--max-restarts); a smaller "
            "live_snapshot_steps narrows the window, and live_redundancy=1 survives two "
            "losses that are not neighbours (in a ring of 4 or more)"
        )

    # ------------------------------------------------------------ the state
    def _used_by_all(self) -> int:
        """Samples of the epoch's order every rank together has used (the sampler's start
        plus each rank's share so far; a padded epoch's end is its length)."""
        trainer = self.trainer
        sampler = trainer.sampler
        assert sampler is not None
        return sampler.used_by_all(
            trainer.state.batches_done * trainer.args.per_device_train_batch_size
        )

    def _entries(self) -> dict[str, Stateful]:
        """The transferred checkpoint entries (plain Statefuls); under ZeRO-1/2 not the model
        and the optimizer, whose pieces travel apart (live_sharded.py), but the buffers."""
        entries = self.trainer.checkpoint_states()
        names = [n for n in _TRANSFERRED if self.sharded is None or n not in _SHARDED]
        return {n: entries[n] for n in names if isinstance(entries.get(n), Stateful)}  # type: ignore[misc]

    def _save(self) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {n: e.state_dict() for n, e in self._entries().items()}
        state["data"] = {"epoch": trainer.state.epoch, "used_by_all": self._used_by_all()}
        runlog = trainer.runlog or trainer.open_runlog()
        state["loss"] = {"before": runlog.loss_before, "steps": runlog.steps_before}
        if self.sharded is not None:
            state["groups"] = trainer.strategy.live_groups(trainer.optimizer)
            state["buffers"] = {n: b.detach().clone() for n, b in trainer.model.named_buffers()}
        return state

    def _load(self, state: dict[str, Any]) -> None:
        for name, entry in self._entries().items():
            entry.load_state_dict(state[name])
        self._data = {k: int(v) for k, v in state["data"].items()}
        runlog = self.trainer.runlog or self.trainer.open_runlog()
        runlog.loss_from(float(state["loss"]["before"]), int(state["loss"]["steps"]))
        buffers = dict(self.trainer.model.named_buffers())
        with torch.no_grad():
            for name, value in state.get("buffers", {}).items():
                buffers[name].copy_(value)

    # ------------------------------------------------------------ the rebuild
    def _rebuild(self, done: Recovered) -> None:
        trainer, started = self.trainer, time.monotonic()
        data = self._data or {"epoch": trainer.state.epoch, "used_by_all": self._used_by_all()}
        self._data = None
        world = trainer.world
        world.rebind(done.rank, done.world_size)  # every part of the run holds this one World
        trainer.rewrap()  # the old wrapper's hooks come off first (Strategy.rewrap)
        if self.sharded is not None:  # ZeRO of the new world, from every old rank's pieces
            self.sharded.restore()
        sampler = trainer.sampler
        assert sampler is not None
        trainer.state.epoch = data["epoch"]
        sampler.set_epoch(data["epoch"])
        sampler.reshard(world.world_size, world.rank, data["used_by_all"])
        trainer.state.batches_done = 0  # the epoch's length from here: Trainer._epoch_steps
        trainer.fold_loss()
        _reseed(trainer.args.seed, done.generation, done.rank)
        self._record(done)
        if self.sharded is not None:  # the new ring's first copies, before any step
            self.sharded.snapshot(self._save)
        who = ", ".join(done.members)
        rebuilt_s = time.monotonic() - started  # the wrapper, ZeRO's re-deal, the first copies
        trainer.report.say(
            f"live recovery: {done.world_size} ranks ({who}) at step {done.step}, "
            f"state from {done.donor}, {done.seconds:.2f} s ({_phases(done.phases)}), "
            f"rebuilt in {rebuilt_s:.2f} s — "
            f"{done.reason}"
        )

    def _record(self, done: Recovered) -> None:
        if not self.trainer.world.is_main:
            return
        entry = dataclasses.asdict(done)
        entry["seconds"] = round(done.seconds, 3)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open_append(self.log_path) as log:  # a planted link is refused, not followed
            log.write(json.dumps(entry) + "\n")


def replayed_admissions() -> list[int] | None:
    """The steps a recorded run let replacements in at, when REPLAY_ENV names its log: the
    same losses (injected alike) and these admissions give the same run, bit for bit."""
    path = os.environ.get(REPLAY_ENV)
    if not path:
        return None
    try:
        entries = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    except (OSError, ValueError) as exc:
        raise ConfigurationError(
            f"{REPLAY_ENV}={path!r} cannot be read as a membership log ({exc}) — point it at "
            f"the {MEMBERSHIP_LOG} of the run to replay"
        ) from exc
    return [int(e["step"]) for e in entries if "replacement is waiting" in e["reason"]]


@contextlib.contextmanager
def restart_if_lost() -> Iterator[None]:
    """Around the run's setup, before its first step: a member lost there leaves the others
    nothing to go on from that a fresh start would not give, and nothing has trained yet,
    so the launcher restarts the worker group (--max-restarts) instead of replacing it."""
    try:
        yield
    except PeerLost:
        fall_back_to_restart()
        raise


def fall_back_to_restart() -> None:
    """Tell this node's launcher that a loss must restart the group (launch/live.py)."""
    directory = os.environ.get(PROGRESS_DIR_VAR)
    if directory:
        (Path(directory) / RESTART_MARK).touch()


def _phases(phases: dict[str, float]) -> str:
    """`agree 0.05, connect 0.03, state 0.04`: where a recovery's seconds went."""
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())


def _reseed(seed: int, generation: int, rank: int) -> None:
    """Each member's generators after a change of members: a function of the seed, the
    generation and the rank, so a replay of the same membership is bit-identical."""
    mixed = (seed * 1_000_003 + generation * 10_007 + rank) % (2**32)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
