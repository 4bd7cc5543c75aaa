"""Checkpoint directories written atomically, verified before they are trusted.

A checkpoint is `output_dir/checkpoint-<step>/`, built as
`checkpoint-<step>.<random>.tmp/` and renamed into place only once complete: every
file is fsynced (those rank 0 writes here, and those every rank wrote
through torch.distributed.checkpoint), then `manifest.json` (the SHA-256 and
size of every file, and each entry's placement) is written last, then the
directory is fsynced and renamed, then its parent is fsynced. A crash at any
point leaves either the old set of checkpoints or the new one, never a torn
directory under the final name. On load the manifest is checked first, so a
truncated or corrupted file, or a manifest that is itself malformed, is a
clear error instead of a confusing unpickling failure, and
the run can skip to the previous checkpoint.

Nothing in output_dir is reached through a symbolic link: a `checkpoint-<step>`
link is not a checkpoint, and a file of a checkpoint must be a regular file
under real folders of it (ground/safe_files.py); names made for writing are
random, so none can be planted in advance.

This module is one process's view of one directory; `lineage.py` says which
checkpoints are the run's, `checkpointer.py` makes the ranks take their turns.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

import torch

from phalanx.errors import CheckpointError
from phalanx.ground.safe_files import (
    create_dir,
    open_new,
    open_regular,
    random_name,
    regular_inside,
)
from phalanx.train.checkpoint.stateful import PLACEMENTS, Placement, per_rank_file, replicated_file

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: entries with placements (sharded ones as DCP directories). 1 (before) had fixed files."""
DCP_METADATA = ".metadata"
_NAME = re.compile(rf"{PREFIX}(\d+)")
_READ_CHUNK = 1 << 20
CORRUPT = "the checkpoint is corrupt; resume from an earlier one"


class _HashingWriter:
    """Hash bytes on their way to the file, so writing needs no second read.

    It also keeps the OSError of a failed write: torch.save reports one as
    "unexpected pos", and the user needs "no space left on device".
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.file.flush()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe_os_error(exc: OSError, path: Path | str | None = None) -> str:
    """ "<file>: no space left on device", the file being the error's own if it names one."""
    reason = (exc.strerror or str(exc)).strip()
    reason = reason[:1].lower() + reason[1:]
    where = exc.filename if exc.filename is not None else path
    return f"{where}: {reason}" if where is not None else reason


def write_file(directory: Path, name: str, obj: Any) -> dict[str, Any]:
    """torch.save `obj` (or write bytes) to the new file directory/name durably; return its
    manifest entry. A failed write raises OSError naming the file and the system's reason."""
    path = directory / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open_new(path)  # a new file in a new folder: nothing there to follow
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    return write_into(file, path, obj)


def write_into(file: IO[bytes], path: Path, obj: Any) -> dict[str, Any]:
    """write_file's writing, into `file` (open, at `path`), which it closes."""
    try:
        with file:
            writer = _HashingWriter(file)
            try:
                if isinstance(obj, bytes):
                    writer.write(obj)
                else:
                    torch.save(obj, writer)  # type: ignore[arg-type]
                file.flush()
                os.fsync(file.fileno())
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.size}


def begin(output_dir: Path, step: int) -> Path:
    """A new, empty checkpoint-<step>.<random>.tmp/: a random name, so that nothing planted
    under a guessable one (a link) is written through or blocks the save."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return create_dir(output_dir, f"{PREFIX}{step}", TMP_SUFFIX)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _hash_and_sync(path: Path) -> dict[str, Any]:
    """The manifest entry of a file another writer made (DCP), fsynced on the way."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(_READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(file.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def seal(
    tmp: Path,
    step: int,
    entries: Mapping[str, Placement],
    written: Mapping[str, dict[str, Any]],
    record: Mapping[str, Any] | None = None,
) -> Path:
    """Manifest every file under `tmp` (hashing those not in `written`), rename into place
    as checkpoint-<step>; `record`: more manifest fields (the lineage's, lineage.py)."""
    files: dict[str, dict[str, Any]] = {}
    directories = {tmp}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = path.relative_to(tmp).as_posix()
        files[name] = dict(written[name]) if name in written else _hash_and_sync(path)
        directories.add(path.parent)
    for directory in directories:
        fsync_dir(directory)
    manifest = {"format": FORMAT_VERSION, "step": step, "entries": dict(entries), "files": files}
    manifest.update(record or {})
    write_file(tmp, MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    final = tmp.with_name(f"{PREFIX}{step}")
    _replace_dir(tmp, final)
    fsync_dir(tmp.parent)
    return final


def write_checkpoint(output_dir: Path, step: int, contents: Mapping[str, Any]) -> Path:
    """Write `contents` (relative name -> object or bytes) as checkpoint-<step>/, atomically.

    One process, replicated entries only: `<name>.pt` files become entries.
    """
    tmp = begin(output_dir, step)
    written = {name: write_file(tmp, name, obj) for name, obj in contents.items()}
    entries: dict[str, Placement] = {
        name.removesuffix(".pt"): "replicated" for name in contents if name.endswith(".pt")
    }
    return seal(tmp, step, entries, written)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename src to dst; an existing dst (the run's own step saved again; lineage.py sets
    anything else aside first) goes to a random `.old` name, then is deleted. A kill
    between the renames leaves that `.old`: the next start puts it back (leftovers.py)."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    old = dst.with_name(random_name(dst.name, OLD_SUFFIX))
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint-<step> directory, highest step first; staging
    folders and links (which phalanx never follows) excluded."""
    if not output_dir.is_dir():
        return []
    found = []
    with os.scandir(output_dir) as entries:
        for entry in entries:
            match = _NAME.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found, reverse=True)


def linked_checkpoints(output_dir: Path) -> list[Path]:
    """The `checkpoint-<step>` names in output_dir that are symbolic links (never followed)."""
    if not output_dir.is_dir():
        return []
    with os.scandir(output_dir) as entries:
        return sorted(Path(e.path) for e in entries if _NAME.fullmatch(e.name) and e.is_symlink())


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as file:
        while chunk := file.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest, checked for shape; any fault is a CheckpointError (corrupt)."""
    try:
        regular_inside(path, MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} has no {MANIFEST}, so it was never completed (or is not a phalanx "
            "checkpoint) — resume from an earlier checkpoint, or delete it"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{describe_os_error(exc)} — {CORRUPT}") from None
    try:
        with open_regular(path / MANIFEST) as file:
            manifest = json.loads(file.read().decode("utf-8"))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}/{MANIFEST} is unreadable ({exc}) — {CORRUPT}") from exc
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{path}/{MANIFEST} is unreadable ({problem}) — {CORRUPT}")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest's shape, or None: checked before anything reads it."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return 'no "files" mapping'
    if manifest.get("format") != FORMAT_VERSION:
        return (
            f"checkpoint format {manifest.get('format')!r}, and this phalanx reads format "
            f"{FORMAT_VERSION}; an older phalanx wrote it"
        )
    for name, entry in manifest["files"].items():
        fits = (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int)
        )
        if not fits:
            return f'the entry for {name!r} lacks "sha256" or "bytes"'
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts:
            return f"the file name {name!r} points outside the checkpoint"
    return _lineage_problem(manifest) or _entries_problem(
        manifest.get("entries"), manifest["files"]
    )


def _lineage_problem(manifest: dict[str, Any]) -> str | None:
    """The lineage fields (lineage.py) are optional: a manifest of before them has none."""
    ident, parent, serial = (manifest.get(k) for k in ("id", "parent", "serial"))
    if ident is None and parent is None and serial is None:
        return None
    if not isinstance(ident, str) or not (parent is None or isinstance(parent, str)):
        return '"id" or "parent" is not a name'
    if not isinstance(serial, int) or isinstance(serial, bool) or serial < 1:
        return f'"serial" is {serial!r}, not a count from 1'
    return None


def _entries_problem(entries: Any, files: dict[str, Any]) -> str | None:
    if not isinstance(entries, dict):
        return 'no "entries" mapping'
    for name, placement in entries.items():
        if placement not in PLACEMENTS:
            return f"entry {name!r} has the unknown placement {placement!r}"
        needed = {
            "replicated": replicated_file(name),
            "per_rank": per_rank_file(name, 0),
            "sharded": f"{name}/{DCP_METADATA}",
        }[placement]
        if needed not in files:
            return f"entry {name!r} ({placement}) has no {needed} among its files"
    return None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against the manifest; return the manifest, or raise CheckpointError.

    Every file must be a regular file under real folders of the checkpoint: a link
    (into another run, say) or a FIFO is refused, never followed or opened.
    """
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist — check the path")
    manifest = read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        try:
            size = regular_inside(path, name).st_size
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing — the checkpoint is incomplete") from None
        except OSError as exc:
            raise CheckpointError(f"{describe_os_error(exc)} — {CORRUPT}") from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes but was written with {entry['bytes']} — it is "
                f"truncated or was changed; {CORRUPT}"
            )
        if _sha256_of(file) != entry["sha256"]:
            raise CheckpointError(f"{file} does not match its checksum — {CORRUPT}")
    return manifest


def checkpoint_bytes(manifest: Mapping[str, Any]) -> int:
    return sum(int(entry["bytes"]) for entry in manifest["files"].values())


def ranks_saved(manifest: Mapping[str, Any], name: str) -> int:
    """How many ranks wrote a per-rank entry: its files are rank-00000.pt, rank-00001.pt, ..."""
    count = 0
    while per_rank_file(name, count) in manifest["files"]:
        count += 1
    return count


def load_file(path: Path, name: str, manifest: Mapping[str, Any] | None = None) -> Any:
    """torch.load one file of a checkpoint onto the CPU, with weights_only=True.

    With `manifest`, a file it does not list is refused: only verified files are read.
    """
    file = path / name
    if manifest is not None and name not in manifest["files"]:
        raise CheckpointError(f"{path}/{MANIFEST} does not list {name} — {CORRUPT}")
    try:
        with open_regular(file) as opened:  # a link or a FIFO planted after the check: refused
            return torch.load(opened, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing — the checkpoint is incomplete") from exc
    except Exception as exc:  # torch raises many types for a bad zip or a refused object
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{file} cannot be loaded ({type(exc).__name__}: {first}) — the checkpoint is "
            "corrupt, or holds objects weights_only loading refuses (nothing in it was run); "
            "resume from an earlier checkpoint"
        ) from exc
