"""Save and load a `dict[str, Stateful]` on every rank at once, failing on every rank together.

Saving takes turns in one temporary directory (directory.py makes it atomic):

1. every rank hands rank 0 its per-rank states (one gather), and rank 0
   makes the empty `checkpoint-<step>.<random>.tmp/` and tells the others its name;
2. every rank calls `save_sharded(<tmp>/<name>)` of each sharded entry (DCP:
   each rank writes its own files);
3. rank 0 writes the replicated entries as `<name>.pt` and the per-rank ones
   as `<name>/rank-XXXXX.pt`;
4. after a barrier, rank 0 hashes and fsyncs every file, including the ones
   the other ranks wrote, writes the manifest, renames, rotates (within the
   run's own lineage: lineage.py).

After each turn all ranks meet in `World.barrier_or_raise`: a failure on any
rank (a full disk, a read-only directory, a state that cannot be pickled) is
one `CheckpointError` on every rank, saying which file and why; rank 0 then
removes the partial `.tmp`, and the previous checkpoints stay as they were.
Sharded entries need a file system every rank sees (as DCP does).

Loading: rank 0 verifies the checkpoint against its manifest (falling back
past corrupt ones when choosing the newest written); every rank then loads the
replicated and per-rank entries (weights_only=True), and then, together,
the sharded ones.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from phalanx.errors import CheckpointError, PhalanxError
from phalanx.ground.safe_files import create_file
from phalanx.runtime import World
from phalanx.train.checkpoint.directory import (
    PREFIX,
    begin,
    checkpoint_bytes,
    describe_os_error,
    discard,
    linked_checkpoints,
    load_file,
    ranks_saved,
    read_manifest,
    verify_checkpoint,
    write_file,
)
from phalanx.train.checkpoint.lineage import Lineage, find_latest_valid, resume_order
from phalanx.train.checkpoint.stateful import (
    Entry,
    Placement,
    ShardedStateful,
    Stateful,
    per_rank_file,
    placement_of,
    replicated_file,
)

_PROBE_BYTES = 1 << 20


class CheckpointFallbackWarning(UserWarning):
    """resume_from_checkpoint=True skipped a newer checkpoint that failed verification."""


@dataclass(frozen=True)
class Saved:
    """What `Checkpointer.save` wrote."""

    path: Path
    bytes: int
    """Every file of the checkpoint, all ranks' parts included."""
    seconds: float


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
        derived: Callable[[Path, Mapping[str, Placement]], None] | None = None,
    ) -> Saved:
        """Write every entry of `states` as checkpoint-<step>; `notes`: extra files for people.

        `derived(staging_dir, placements)` runs on rank 0 once every entry is written,
        to add files made from them (the model in Hugging Face's format); they are
        sealed with the rest.
        """
        started = time.perf_counter()
        placements = {name: placement_of(entry) for name, entry in states.items()}
        per_rank = {
            name: self.world.all_gather_state(_stateful(name, entry).state_dict())
            for name, entry in states.items()
            if placements[name] == "per_rank"
        }
        tmp = self._begin(step)
        for name, entry in states.items():
            if placements[name] == "sharded":
                save = partial(_sharded(name, entry).save_sharded, tmp / name)
                self._turn(tmp, step, save, everyone=True, part=name)
        written: dict[str, dict[str, Any]] = {}

        def write_on_main() -> None:
            for name, entry in states.items():
                if placements[name] == "replicated":
                    file = replicated_file(name)
                    written[file] = write_file(tmp, file, _stateful(name, entry).state_dict())
                for rank, state in enumerate(per_rank.get(name, [])):
                    written[per_rank_file(name, rank)] = write_file(
                        tmp, per_rank_file(name, rank), state
                    )
            for file, data in (notes or {}).items():
                written[file] = write_file(tmp, file, data)
            if derived is not None:
                derived(tmp, placements)

        self._turn(tmp, step, write_on_main, everyone=False)
        sizes: list[int] = []

        def seal_on_main() -> None:
            sealed = self.lineage.seal(tmp, step, placements, written)
            sizes.append(checkpoint_bytes(read_manifest(sealed)))  # before anything is deleted
            self.lineage.rotate()

        self._turn(tmp, step, seal_on_main, everyone=False)
        size = int(self.world.broadcast_json(sizes[0] if sizes else 0))
        return Saved(self.output_dir / f"{PREFIX}{step}", size, time.perf_counter() - started)

    def _begin(self, step: int) -> Path:
        """Rank 0 makes the staging folder (a random name) and every rank learns it."""
        made: list[Path] = []
        self._turn(None, step, lambda: made.append(begin(self.output_dir, step)), everyone=False)
        return Path(self.world.broadcast_json(str(made[0]) if made else None))

    def _turn(
        self,
        tmp: Path | None,
        step: int,
        action: Callable[[], object],
        everyone: bool,
        part: str | None = None,
    ) -> None:
        """Run `action` (on rank 0, or on every rank), then meet; any failure fails all.

        `part` names the sharded entry every rank is writing, for the message.
        """
        error: PhalanxError | None = None
        if everyone or self.world.is_main:
            try:
                action()
            except PhalanxError as exc:
                error = exc
            except _failures() as exc:  # DCP's is a BaseException
                error = CheckpointError(self._write_failure(tmp, step, exc, part))
        try:
            self.world.barrier_or_raise(error)
        except PhalanxError:
            if self.world.is_main and tmp is not None:
                discard(tmp)  # every rank is past its writes: nothing is still writing here
            raise

    def _write_failure(
        self, tmp: Path | None, step: int, exc: BaseException, part: str | None
    ) -> str:
        existing = resume_order(self.output_dir)
        kept = f"{existing[0].name} is intact" if existing else "there is no earlier checkpoint"
        where = self.output_dir if tmp is None else tmp if part is None else tmp / part
        reason, on_disk = _reason(exc, where)
        fix = (
            f"free space or fix permissions in {self.output_dir}"
            if on_disk
            else "keep every state to tensors and plain values"
        )
        return f"could not write {PREFIX}{step}: {reason} — {fix}; {kept}"

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
                    _stateful(name, entry).load_state_dict(state)
                elif placement == "per_rank":
                    rank = self.world.rank % ranks_saved(manifest, name)
                    state = load_file(path, per_rank_file(name, rank), manifest)
                    _stateful(name, entry).load_state_dict(state)

        self._load_turn(path, load_local)
        for name, entry in states.items():
            if placement_of(entry) == "sharded":
                self._load_turn(path, partial(_sharded(name, entry).load_sharded, path / name))

    def _load_turn(self, path: Path, action: Callable[[], None]) -> None:
        error: PhalanxError | None = None
        try:
            action()
        except PhalanxError as exc:
            error = exc
        except _failures() as exc:  # load_state_dict mismatches, DCP
            error = CheckpointError(
                f"{path} does not fit this model or optimizer ({type(exc).__name__}: "
                f"{_first_line(exc)}) — resume with the model and optimizer that wrote it"
            )
        self.world.barrier_or_raise(error)


def _stateful(name: str, entry: object) -> Stateful:
    if not isinstance(entry, Stateful):
        raise CheckpointError(
            f"checkpoint entry {name!r} has no state_dict/load_state_dict — give it those "
            "methods, or declare it sharded (save_sharded/load_sharded)"
        )
    return entry


def _sharded(name: str, entry: object) -> ShardedStateful:
    if not isinstance(entry, ShardedStateful):
        raise CheckpointError(
            f"checkpoint entry {name!r} is declared sharded but has no save_sharded/"
            "load_sharded — give it those methods, or declare it replicated"
        )
    return entry


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reason(exc: BaseException, tmp: Path) -> tuple[str, bool]:
    """Why a write failed, in the system's words where they can be found; and whether the
    file system (not the state) is to blame."""
    if isinstance(exc, OSError):
        return describe_os_error(exc), True
    if isinstance(exc, _dcp_errors()):
        failures: dict[int, Any] = exc.failures  # type: ignore[attr-defined]
        ranks = sorted(failures)
        # torch.save turns a failed write into "unexpected pos"; probing the same
        # directory brings the system's reason back.
        probed = _probe(tmp)
        cause = probed or _first_line(failures[ranks[0]][0])
        return f"rank(s) {ranks} could not write their shards ({cause})", probed is not None
    probed = _probe(tmp) if "unexpected pos" in str(exc) else None
    if probed is not None:
        return probed, True
    return f"{type(exc).__name__}: {_first_line(exc)}", False


def _probe(directory: Path) -> str | None:
    """Write and sync a small file in `directory`: the reason it fails, or None."""
    probe: Path | None = None
    try:
        probe, file = create_file(directory, ".phalanx-probe")
        with file:
            file.write(bytes(_PROBE_BYTES))
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        return describe_os_error(OSError(exc.errno, exc.strerror), directory)
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.unlink()
    return None


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """DCP's CheckpointException, once torch.distributed.checkpoint is loaded (only
    sharded state loads it, lazily: seconds of import); before, none can be raised."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()


def _failures() -> tuple[type[BaseException], ...]:
    """What a save or load step may raise that becomes a CheckpointError."""
    return (Exception, *_dcp_errors())
