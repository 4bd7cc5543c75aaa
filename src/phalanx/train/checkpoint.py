"""Checkpoint directories written atomically, verified before they are trusted.

A checkpoint is `output_dir/checkpoint-<step>/`, built as
`checkpoint-<step>.tmp/` and renamed into place only once complete: every
file is fsynced, then `manifest.json` (the SHA-256 and size of every file)
is written last, then the directory is fsynced and renamed, then its parent
is fsynced. A crash at any point leaves either the old set of checkpoints or
the new one, never a torn directory under the final name. On load the
manifest is checked first, so a truncated or corrupted file is a clear error
instead of a confusing unpickling failure, and `find_latest_valid` can skip
to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from phalanx.errors import CheckpointError

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_NAME = re.compile(rf"{PREFIX}(\d+)")
_READ_CHUNK = 1 << 20


class _HashingWriter:
    """Hash bytes on their way to the file, so writing needs no second read."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _fsync_dir(path: Path) -> None:
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


def _write_file(path: Path, obj: Any) -> dict[str, Any]:
    """torch.save `obj` (or write bytes) durably; return its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        writer = _HashingWriter(file)
        if isinstance(obj, bytes):
            writer.write(obj)
        else:
            torch.save(obj, writer)  # type: ignore[arg-type]
        file.flush()
        os.fsync(file.fileno())
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.size}


def write_checkpoint(output_dir: Path, step: int, contents: Mapping[str, Any]) -> Path:
    """Write `contents` (relative name -> object or bytes) as checkpoint-<step>/, atomically."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f"{PREFIX}{step}{TMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)  # a torn leftover of a killed run
    tmp.mkdir()
    entries = {name: _write_file(tmp / name, obj) for name, obj in contents.items()}
    for sub in {(tmp / name).parent for name in contents}:
        _fsync_dir(sub)
    manifest = {"format": FORMAT_VERSION, "step": step, "files": entries}
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    _replace_dir(tmp, final)
    _fsync_dir(output_dir)
    return final


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


def rotate_checkpoints(output_dir: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; return what was deleted."""
    if keep is None:
        return []
    doomed = [path for _, path in list_checkpoints(output_dir)[keep:]]
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
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}, so it was never completed (or is not a phalanx "
            "checkpoint) — resume from an earlier checkpoint, or delete it"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise CheckpointError(
            f"{path}/{MANIFEST} is unreadable ({exc}) — the checkpoint is corrupt; "
            "resume from an earlier one"
        ) from exc
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(
            f"{path}/{MANIFEST} is unreadable ({problem}) — the checkpoint is corrupt; "
            "resume from an earlier one"
        )
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest's shape, or None: checked before anything reads it."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return 'no "files" mapping'
    for name, entry in manifest["files"].items():
        fits = (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int)
        )
        if not fits:
            return f'the entry for {name!r} lacks "sha256" or "bytes"'
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
                "truncated or was changed; resume from an earlier checkpoint"
            )
        if _sha256_of(file) != entry["sha256"]:
            raise CheckpointError(
                f"{file} does not match its checksum — the checkpoint is corrupt; resume "
                "from an earlier checkpoint"
            )
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


def load_file(path: Path, name: str) -> Any:
    """torch.load one file of a checkpoint onto the CPU, with weights_only=True."""
    file = path / name
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing — the checkpoint is incomplete") from exc
    except Exception as exc:  # torch raises many types for a bad zip or a refused object
        raise CheckpointError(
            f"{file} cannot be loaded ({type(exc).__name__}: {exc}) — the checkpoint is "
            "corrupt, or holds objects weights_only loading refuses; resume from an "
            "earlier checkpoint"
        ) from exc
