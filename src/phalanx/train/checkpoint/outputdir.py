"""What the Trainer checks in output_dir before it trains, and how it says what it does.

Two mistakes are caught before the first step, on every rank together:
an output_dir that cannot be written (found otherwise at the first save, an
hour in), and a fresh run started into a directory that holds another run's
checkpoints (which it would otherwise take over: its checkpoints and the old
ones interleave, and a later resume picks whichever is newest).

And what an earlier run left unfinished is said, not swept away in silence: a
`checkpoint-<step>.<random>.tmp/` is a save that never completed (its writer was
killed), an `IncompleteSaveWarning` naming the step; a `checkpoint-<step>.<random>.old/`
with no `checkpoint-<step>` beside it is a replacement cut between its two
renames, and is put back.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

from phalanx.errors import ConfigurationError, OutputError, PhalanxError
from phalanx.ground.safe_files import create_file
from phalanx.runtime import World
from phalanx.train.checkpoint.directory import (
    OLD_SUFFIX,
    PREFIX,
    TMP_SUFFIX,
    describe_os_error,
    list_checkpoints,
)
from phalanx.train.config.args import TrainingArguments

_LEFTOVER = re.compile(
    rf"{PREFIX}(\d+)(?:\.[0-9a-f]+)?({re.escape(TMP_SUFFIX)}|{re.escape(OLD_SUFFIX)})"
)
"""checkpoint-<step>[.<random>].tmp or .old: what a save or a replacement left when cut."""

# What `phalanx launch` and torchrun export to every worker of a (re)started job.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"


def restart_note(environ: Mapping[str, str] = os.environ) -> str | None:
    """ "restart 1 of 3" when the launcher restarted this job, else None."""
    try:
        count = int(environ.get(RESTART_COUNT, "0") or 0)
    except ValueError:
        return None
    if count <= 0:
        return None
    maximum = environ.get(MAX_RESTARTS, "")
    return f"restart {count} of {maximum}" if maximum.isdigit() else f"restart {count}"


class IncompleteSaveWarning(UserWarning):
    """An earlier run's save of a checkpoint never completed (its staging folder was left)."""


def writes_files(args: TrainingArguments) -> bool:
    """Whether a run with `args` writes into output_dir (checkpoints or metric files)."""
    return args.save_steps > 0 or any(sink != "console" for sink in args.report_to)


def prepare_output_dir(world: World, args: TrainingArguments, fresh: bool) -> None:
    """Collective: check output_dir is writable and, on a fresh start, holds no checkpoint.

    With overwrite_output_dir=True a fresh start deletes the old checkpoints
    first instead. Rank 0 looks; every rank raises what it found.
    """
    error: PhalanxError | None = None
    if world.is_main:
        try:
            _prepare_locally(Path(args.output_dir), args, fresh)
        except PhalanxError as exc:
            error = exc
    world.barrier_or_raise(error)


def _prepare_locally(output_dir: Path, args: TrainingArguments, fresh: bool) -> None:
    if writes_files(args):
        check_writable(output_dir)
    found = list_checkpoints(output_dir) if fresh else []
    if found and not args.overwrite_output_dir:
        raise ConfigurationError(
            f"output_dir={output_dir} already holds checkpoints (the newest is "
            f"{found[0][1].name}) and this run starts afresh — pass "
            "resume_from_checkpoint=True to continue that run, or overwrite_output_dir=True "
            "(--overwrite_output_dir) to delete its checkpoints and start again"
        )
    try:
        for _, path in found:
            shutil.rmtree(path)
        for note in sweep_leftovers(output_dir):
            warnings.warn(note, IncompleteSaveWarning, stacklevel=5)
    except OSError as exc:
        raise OutputError(
            f"cannot delete the old checkpoints in {output_dir} ({describe_os_error(exc)}) — "
            "delete them yourself, or pass another output_dir"
        ) from exc


def sweep_leftovers(output_dir: Path) -> list[str]:
    """Remove what interrupted saves left in output_dir, put back a checkpoint whose
    replacement was cut; one sentence for each (links are left alone: never followed)."""
    if not output_dir.is_dir():
        return []
    notes = []
    with os.scandir(output_dir) as entries:
        found = [
            (e, match)
            for e in entries
            if (match := _LEFTOVER.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)
        ]
    for entry, match in sorted(found, key=lambda pair: pair[0].name):
        step, kind, path = int(match.group(1)), match.group(2), Path(entry.path)
        final = output_dir / f"{PREFIX}{step}"
        if kind == TMP_SUFFIX:
            shutil.rmtree(path)
            notes.append(
                f"{final.name} was never completed: an earlier run's save of step {step} "
                f"stopped part-way (killed while writing; {path.name} was left, now removed) "
                "— the run goes on from the newest complete checkpoint"
            )
        elif os.path.lexists(final):
            shutil.rmtree(path)  # the replacement had completed: only the old copy was left
        else:
            path.rename(final)
            notes.append(
                f"{final.name} was being replaced when an earlier run stopped: the previous "
                f"{final.name} ({path.name}) was put back"
            )
    return notes


def check_writable(output_dir: Path) -> None:
    """Create output_dir and write (then delete) a small file in it, or raise OutputError."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe, file = create_file(output_dir, ".phalanx-write-test")
        with file:
            file.write(b"phalanx")
            file.flush()
            os.fsync(file.fileno())
        probe.unlink()
    except OSError as exc:
        raise OutputError(
            f"output_dir={output_dir} cannot be written ({describe_os_error(exc)}) — pass an "
            "output_dir you can write to, or fix its permissions or free space"
        ) from exc
