"""Checkpoint directories written atomically, verified before they are trusted.

A checkpoint is `output_dir/checkpoint-<step>/`, built as
`checkpoint-<step>.tmp/` and renamed into place only once complete: every
file is fsynced (those rank 0 writes here, and those every rank wrote
through torch.distributed.checkpoint), then `manifest.json` (the SHA-256 and
size of every file, and each entry's placement) is written last, then the
directory is fsynced and renamed, then its parent is fsynced. A crash at any
point leaves either the old set of checkpoints or the new one, never a torn
directory under the final name. On load the manifest is checked first, so a
truncated or corrupted file, or a manifest that is itself malformed, is a
clear error instead of a confusing unpickling failure, and
`find_latest_valid` can skip to the previous checkpoint.

This module is one process's view of the directory; `checkpointer.py` makes
the ranks take their turns in it.
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
from phalanx.train.checkpoint.stateful import PLACEMENTS, Placement, per_rank_file, replicated_file

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
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
    """torch.save `obj` (or write bytes) to directory/name durably; return its manifest entry.

    A failed write raises OSError naming the file and the system's reason.
    """
    path = directory / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as file:
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


def staging_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{PREFIX}{step}{TMP_SUFFIX}"


def begin(output_dir: Path, step: int) -> Path:
    """An empty checkpoint-<step>.tmp/ (a torn leftover of a killed run is removed first)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


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
) -> Path:
    """Manifest every file under `tmp` (hashing those not in `written`), rename into place."""
    files: dict[str, dict[str, Any]] = {}
    directories = {tmp}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = path.relative_to(tmp).as_posix()
        files[name] = dict(written[name]) if name in written else _hash_and_sync(path)
        directories.add(path.parent)
    for directory in directories:
        fsync_dir(directory)
    manifest = {"format": FORMAT_VERSION, "step": step, "entries": dict(entries), "files": files}
    write_file(tmp, MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    final = tmp.with_name(tmp.name.removesuffix(TMP_SUFFIX))
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
    """Rename src to dst; an existing dst (the same step saved again) is moved aside first."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint-<step> directory, newest first; .tmp ones excluded."""
    if not output_dir.is_dir():
        return []
    found = []
    for entry in output_dir.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def remove_torn(output_dir: Path) -> list[Path]:
    """Delete checkpoint-*.tmp directories: by construction they never finished."""
    if not output_dir.is_dir():
        return []
    torn = [p for p in output_dir.glob(f"{PREFIX}*{TMP_SUFFIX}") if p.is_dir()]
    for path in torn:
        shutil.rmtree(path, ignore_errors=True)
    return torn


def rotate_checkpoints(
    output_dir: Path, keep: int | None, protect: Path | None = None
) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and `protect`); return what was deleted."""
    if keep is None:
        return []
    doomed = [path for _, path in list_checkpoints(output_dir)[keep:] if path != protect]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest, checked for shape; any fault is a CheckpointError (corrupt)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}, so it was never completed (or is not a phalanx "
            "checkpoint) — resume from an earlier checkpoint, or delete it"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
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
    return _entries_problem(manifest.get("entries"), manifest["files"])


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
    """Check every file against the manifest; return the manifest, or raise CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist — check the path")
    manifest = read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing — the checkpoint is incomplete")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes but was written with {entry['bytes']} — it is "
                f"truncated or was changed; {CORRUPT}"
            )
        if _sha256_of(file) != entry["sha256"]:
            raise CheckpointError(f"{file} does not match its checksum — {CORRUPT}")
    return manifest


def find_latest_valid(output_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and why each newer one was skipped."""
    skipped: list[str] = []
    for _, path in list_checkpoints(output_dir):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return path, skipped
    return None, skipped


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
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing — the checkpoint is incomplete") from exc
    except Exception as exc:  # torch raises many types for a bad zip or a refused object
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{file} cannot be loaded ({type(exc).__name__}: {first}) — the checkpoint is "
            "corrupt, or holds objects weights_only loading refuses (nothing in it was run); "
            "resume from an earlier checkpoint"
        ) from exc
