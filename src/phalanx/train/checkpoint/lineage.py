"""Which checkpoints in output_dir are the run's own, which is the newest, which may go.

Step numbers alone cannot say. A run resumed from an older checkpoint (a
rollback: from checkpoint-8 while checkpoint-12 exists) starts a new branch;
the abandoned branch's checkpoint-12 has the higher step but is not newer, and
ranking by step made `save_total_limit` delete the checkpoint resumed from and
the new branch's own saves, and made a later `resume_from_checkpoint=True`
pick the abandoned branch. So each manifest records three more fields:

- `id`: a random name of this checkpoint;
- `parent`: the id of the checkpoint it continues (the run's previous save, or
  the checkpoint the run resumed from; none for a run's first save from scratch);
- `serial`: one more than the largest serial in output_dir when it was sealed,
  the order of writing, with no clock involved.

A run's lineage is its newest checkpoint and that one's parents, as far as they
are in output_dir. Rotation (`save_total_limit`) deletes only the lineage's
older checkpoints, so a checkpoint of another branch, or one the run did not
write, is never deleted by it, and the checkpoint resumed from goes only once
`save_total_limit` newer ones of the run's own are complete. A checkpoint of
another branch at a step the run saves is moved aside, not overwritten:
`checkpoint-12.<random>.abandoned`, with one line. `resume_from_checkpoint=True`
means the newest written (the highest serial), falling back along its parents.

Checkpoints from before these fields (no `id`) form one line ordered by step,
as they did, and count as older than any with a serial.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import CheckpointError
from phalanx.ground.safe_files import random_name
from phalanx.train.checkpoint.directory import (
    PREFIX,
    list_checkpoints,
    read_manifest,
    seal,
    verify_checkpoint,
)
from phalanx.train.checkpoint.stateful import Placement

ABANDONED_SUFFIX = ".abandoned"
_LEGACY = "legacy:"


@dataclass(frozen=True)
class Record:
    """One checkpoint directory's place in its lineage."""

    path: Path
    step: int
    id: str
    parent: str | None
    serial: int
    """0 for a checkpoint written before serials were recorded."""


@dataclass(frozen=True)
class Scan:
    """The checkpoints of output_dir: those whose manifest reads, and those whose does not."""

    records: list[Record]
    unreadable: list[tuple[int, Path]]

    def by_path(self, path: Path) -> Record | None:
        return next((r for r in self.records if r.path == path), None)


def scan(output_dir: Path) -> Scan:
    """Every checkpoint-<step> directory of output_dir (links excluded), with its lineage."""
    records: list[Record] = []
    legacy: list[tuple[int, Path]] = []
    unreadable: list[tuple[int, Path]] = []
    for step, path in list_checkpoints(output_dir):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            unreadable.append((step, path))
            continue
        if manifest.get("id") is None:
            legacy.append((step, path))
        else:
            records.append(
                Record(path, step, manifest["id"], manifest["parent"], manifest["serial"])
            )
    legacy.sort()
    for i, (step, path) in enumerate(legacy):  # one line by step, as rotation once assumed
        parent = legacy_id(legacy[i - 1][1]) if i else None
        records.append(Record(path, step, legacy_id(path), parent, 0))
    return Scan(records, unreadable)


def legacy_id(path: Path) -> str:
    """The id a checkpoint without one is known by: its directory's name."""
    return _LEGACY + path.name


def lineage_of(head: str | None, records: list[Record]) -> list[Record]:
    """`head` and its parents present in `records`, newest first."""
    by_id = {r.id: r for r in records}
    line: list[Record] = []
    seen: set[str] = set()
    while head is not None and head in by_id and head not in seen:
        seen.add(head)
        line.append(by_id[head])
        head = by_id[head].parent
    return line


def newest(records: list[Record]) -> Record | None:
    """The checkpoint written last: the highest serial (by step among those without)."""
    return max(records, key=lambda r: (r.serial, r.step), default=None)


def resume_order(output_dir: Path) -> list[Path]:
    """The order `resume_from_checkpoint=True` tries checkpoints in: the newest written,
    then its parents, then the rest, newest first. Those whose manifest does not read
    come first where their step is at least the newest's (they may be the newest; they
    will fail verification and be named), last otherwise."""
    found = scan(output_dir)
    head = newest(found.records)
    line = lineage_of(head.id if head else None, found.records)
    rest = sorted(
        (r for r in found.records if r not in line), key=lambda r: (r.serial, r.step), reverse=True
    )
    least = head.step if head else -1
    early = [p for step, p in found.unreadable if step >= least]
    late = [p for step, p in found.unreadable if step < least]
    return early + [r.path for r in line] + [r.path for r in rest] + late


def find_latest_valid(output_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (resume_order), and why each before it failed."""
    skipped: list[str] = []
    for path in resume_order(output_dir):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return path, skipped
    return None, skipped


class Lineage:
    """Rank 0's account of the run's own checkpoints in output_dir: what a save records,
    what it moves aside, and what `save_total_limit` deletes."""

    def __init__(
        self, output_dir: Path, keep: int | None, say: Callable[[str], None] = print
    ) -> None:
        self.output_dir = output_dir
        self.keep = keep
        self.say = say
        self.head: str | None = None
        """The id of the run's newest checkpoint: the last saved, or the one resumed from."""
        self.protect: Path | None = None
        """A checkpoint rotation keeps whatever its age (load_best_model_at_end's best)."""
        self._told_others = False

    def continue_from(self, checkpoint: Path) -> None:
        """The run resumes from `checkpoint` (verified): its next save is that one's child."""
        manifest = read_manifest(checkpoint)
        ident = manifest.get("id")
        self.head = ident if isinstance(ident, str) else legacy_id(checkpoint)

    def seal(
        self,
        tmp: Path,
        step: int,
        entries: Mapping[str, Placement],
        written: Mapping[str, dict[str, Any]],
    ) -> Path:
        """directory.seal with the lineage's fields, as checkpoint-<step>; whatever is at
        that name and is not the run's own is moved aside first."""
        found = scan(self.output_dir)
        parent = self.head
        if parent is None:  # a replacement rank 0 under live recovery knows no head
            latest = newest(found.records)
            parent = latest.id if latest else None
        final = self.output_dir / f"{PREFIX}{step}"
        there = found.by_path(final)
        own = {r.id for r in lineage_of(parent, found.records)}
        if there is not None and there.id in own:
            if there.id == parent:  # the same step saved again: it takes the old one's place
                parent = there.parent
        elif there is not None:
            self._set_aside(final, "is another branch's (this run resumed from an earlier one)")
        elif final.exists() or final.is_symlink():
            self._set_aside(
                final,
                "is not a checkpoint this run can read (a link, a file, or a "
                "checkpoint whose manifest does not read)",
            )
        serial = 1 + max((r.serial for r in found.records), default=0)
        ident = secrets.token_hex(8)
        path = seal(tmp, step, entries, written, {"id": ident, "parent": parent, "serial": serial})
        self.head = ident
        return path

    def _set_aside(self, final: Path, why: str) -> None:
        """Rename what holds the name of the checkpoint being sealed (a link is renamed as
        itself, never followed), and say so in one line."""
        aside = final.with_name(random_name(final.name, ABANDONED_SUFFIX))
        final.rename(aside)
        self.say(
            f"{final} {why}, and this run saves that step: moved aside to {aside.name} — "
            "delete it when you no longer need it"
        )

    def rotate(self) -> list[Path]:
        """Delete the lineage's checkpoints past the newest `keep` (never `protect`, never
        another branch's); return what was deleted."""
        if self.keep is None:
            return []
        found = scan(self.output_dir)
        line = lineage_of(self.head, found.records)
        doomed = [r.path for r in line[self.keep :] if r.path != self.protect]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        others = [r.path.name for r in found.records if r not in line]
        if others and not self._told_others:
            self._told_others = True
            self.say(
                f"save_total_limit counts this run's own checkpoints and leaves the "
                f"{len(others)} of another branch in {self.output_dir} "
                f"({', '.join(sorted(others))}); delete them when you no longer need them"
            )
        return doomed
