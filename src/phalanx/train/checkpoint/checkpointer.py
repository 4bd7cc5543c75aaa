"""Save and load a `dict[str, Stateful]` on every rank at once, failing on every rank together.

Saving is writes.py's two halves: `stage` at the step boundary, then `write`,
either there and then (`save`: complete on return) or on a writer thread while
training goes on (`start_background`, at most one in flight; background.py).

Loading: rank 0 verifies the checkpoint against its manifest (falling back
past corrupt ones when choosing the newest written); every rank then loads the
replicated and per-rank entries (weights_only=True), and then, together,
the sharded ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from phalanx.errors import CheckpointError, PhalanxError
from phalanx.offload.held import SaveHold
from phalanx.runtime import World
from phalanx.train.checkpoint import writes
from phalanx.train.checkpoint.background import BackgroundWriter
from phalanx.train.checkpoint.directory import (
    describe_os_error,
    linked_checkpoints,
    load_file,
    ranks_saved,
    read_manifest,
    verify_checkpoint,
)
from phalanx.train.checkpoint.failures import failures, first_line
from phalanx.train.checkpoint.lineage import Lineage, find_latest_valid
from phalanx.train.checkpoint.stateful import (
    Entry,
    Placement,
    per_rank_file,
    placement_of,
    replicated_file,
    sharded_of,
    stateful_of,
)
from phalanx.train.checkpoint.writes import Saved

__all__ = ["CheckpointFallbackWarning", "Checkpointer", "Saved"]


class CheckpointFallbackWarning(UserWarning):
    """resume_from_checkpoint=True skipped a newer checkpoint that failed verification."""


class Checkpointer:
    """Writes and reads `output_dir/checkpoint-<step>/` for a job; every rank calls each method."""

    def __init__(
        self,
        world: World,
        output_dir: Path,
        keep: int | None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.world = world
        self.output_dir = output_dir
        self.keep = keep
        self.lineage = Lineage(output_dir, keep, say)
        """Rank 0's: which checkpoints are the run's own (what rotation may delete)."""
        self.say = say
        self.background: BackgroundWriter[Saved] = BackgroundWriter(world)
        """The save written while training goes on, if one is in flight."""
        self._pool: list[Any] = []
        """The last background save's host memory, for the next one's copy (staging.py)."""

    @property
    def protect(self) -> Path | None:
        """A checkpoint rotation keeps whatever its age (load_best_model_at_end's best)."""
        return self.lineage.protect

    @protect.setter
    def protect(self, path: Path | None) -> None:
        self.lineage.protect = path

    # ------------------------------------------------------------------ save
    def save(
        self,
        states: Mapping[str, Entry],
        step: int,
        notes: Mapping[str, bytes] | None = None,
        derived: writes.Derived | None = None,
    ) -> Saved:
        """Write every entry of `states` as checkpoint-<step> now; `notes`: extra files for
        people. Complete on return.

        `derived(staging_dir, placements)` runs on rank 0 once every entry is written,
        to add files made from them (the model in Hugging Face's format); they are
        sealed with the rest.
        """
        staged = writes.stage(self.world, self.output_dir, states, step, notes, derived, False)
        return writes.write(self.world, self.lineage, staged)

    def start_background(
        self,
        states: Mapping[str, Entry],
        step: int,
        notes: Mapping[str, bytes] | None = None,
        derived: writes.Derived | None = None,
        timeout_s: float | None = None,
        validate: Callable[[writes.Staged, Callable[[Any], Any]], PhalanxError | None]
        | None = None,
        hold: SaveHold | None = None,
    ) -> writes.Staged:
        """Collective: copy every rank's part of checkpoint-<step> to host memory now, and
        write it on the writer thread while training goes on; `background.collect()`
        returns its `Saved` (or raises its error). The previous one must be collected.
        `timeout_s`: how long the writers' collectives may block (its group is made at the
        first background save); `validate`: run on every rank's copy before it is written
        (a refusal fails the save on every rank); `hold`: the offloaded tensors it keeps
        still are written from their files, not copied (offload/held.py)."""
        assert not self.background.in_flight, "collect the save in flight first"
        writers = self.background.writers_world(timeout_s)
        pool, self._pool = self._pool, []
        staged = writes.stage(
            self.world, self.output_dir, states, step, notes, derived, True, pool, hold
        )
        self._pool = staged.buffers  # reused once this save is written (staging.py)
        staged.validate = validate
        self.background.start(step, partial(writes.write, writers, self.lineage, staged))
        return staged

    def can_write_in_background(self, states: Mapping[str, Entry]) -> bool:
        """Whether every sharded entry can hand its state over to be copied (writes.py), and
        the run's group is the default one (the writers' group is made over its ranks)."""
        import torch.distributed as dist

        return self.world.process_group is dist.group.WORLD and writes.can_stage(states)

    # ------------------------------------------------------------------ choose
    def choose(self, resume: bool | str | Path) -> Path | None:
        """The checkpoint to resume from, chosen by rank 0 and the same on every rank.

        True: the newest valid one in output_dir, falling back past corrupt ones
        with a warning; None when output_dir has no checkpoint yet (a first run).
        A path: that checkpoint, which must be valid.
        """
        chosen: str | None = None
        error: PhalanxError | None = None
        if self.world.is_main:
            try:
                found = self._choose_locally(resume)
                chosen = None if found is None else str(found)
            except PhalanxError as exc:
                error = exc
            except OSError as exc:
                error = CheckpointError(
                    f"cannot read checkpoints in {self.output_dir} ({describe_os_error(exc)}) "
                    "— check the directory and its permissions"
                )
            except Exception as exc:  # whatever a malformed file causes, one error everywhere
                error = CheckpointError(
                    f"cannot read checkpoints in {self.output_dir} ({type(exc).__name__}: "
                    f"{exc}) — the checkpoint is corrupt; resume from an earlier one"
                )
        self.world.barrier_or_raise(error)
        chosen = self.world.broadcast_json(chosen)
        return None if chosen is None else Path(chosen)

    def _choose_locally(self, resume: bool | str | Path) -> Path | None:
        if resume is not True:
            given = Path(resume)  # type: ignore[arg-type]
            verify_checkpoint(given)
            self.lineage.continue_from(given)
            return given
        for link in linked_checkpoints(self.output_dir):
            self.say(
                f"{link} is a symbolic link, and phalanx follows no link in output_dir: it is "
                "not a checkpoint of this run (pass a path to resume from another run's)"
            )
        path, skipped = find_latest_valid(self.output_dir)
        if path is None and skipped:
            raise CheckpointError(
                f"resume_from_checkpoint=True found checkpoints in {self.output_dir} but none "
                f"is valid ({'; '.join(skipped)}) — delete them to start afresh, or pass a path"
            )
        for reason in skipped:
            warnings.warn(
                f"skipping a checkpoint that failed verification: {reason}; resuming from "
                f"{path} instead",
                CheckpointFallbackWarning,
                stacklevel=5,
            )
        if path is not None:
            self.lineage.continue_from(path)
        return path

    # ------------------------------------------------------------------ load
    def load(self, path: Path, states: Mapping[str, Entry]) -> None:
        """Load every entry from `path` (already verified by rank 0); every rank calls it."""
        manifest: dict[str, Any] = {}

        def load_local() -> None:
            manifest.update(read_manifest(path))
            for name, entry in states.items():
                _check_placement(path, name, placement_of(entry), manifest["entries"])
            for name, entry in states.items():
                placement = placement_of(entry)
                if placement == "replicated":
                    state = load_file(path, replicated_file(name), manifest)
                    stateful_of(name, entry).load_state_dict(state)
                elif placement == "per_rank":
                    rank = self.world.rank % ranks_saved(manifest, name)
                    state = load_file(path, per_rank_file(name, rank), manifest)
                    stateful_of(name, entry).load_state_dict(state)

        self._load_turn(path, load_local)
        for name, entry in states.items():
            if placement_of(entry) == "sharded":
                self._load_turn(path, partial(sharded_of(name, entry).load_sharded, path / name))

    def _load_turn(self, path: Path, action: Callable[[], None]) -> None:
        error: PhalanxError | None = None
        try:
            action()
        except PhalanxError as exc:
            error = exc
        except failures() as exc:  # load_state_dict mismatches, DCP
            error = CheckpointError(
                f"{path} does not fit this model or optimizer ({type(exc).__name__}: "
                f"{first_line(exc)}) — resume with the model and optimizer that wrote it"
            )
        self.world.barrier_or_raise(error)


def _check_placement(path: Path, name: str, mine: Placement, saved: Mapping[str, str]) -> None:
    if name not in saved:
        raise CheckpointError(
            f"{path} holds no {name!r} state, which this run needs — resume with the settings "
            "that wrote it (fp16 adds a scaler)"
        )
    if saved[name] != mine:
        raise CheckpointError(
            f"{path} holds {name!r} as {saved[name]} state but this run keeps it {mine} — "
            "resume with the settings that wrote it (zero_stage decides the optimizer's; "
            "see its args.json)"
        )
