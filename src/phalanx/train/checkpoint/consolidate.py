"""`phalanx consolidate CHECKPOINT_DIR OUT.pt`: any phalanx checkpoint as one plain file.

The output is `torch.save({"model": state_dict, "optimizer": state_dict})`:
whole tensors in the plain model's keys and the plain optimizer's format, so
it loads with `torch.load(weights_only=True)` without phalanx, into the plain
model and the plain optimizer class. One process, no process group: the
sharded entries (ZeRO's optimizer, stage 3's model) are read through
phalanx.runtime.safe_dcp (DCP, with nothing in the files run). Stage 3's entries hold
DTensors of the whole shapes and its optimizer state keyed by parameter name
(torch's `get_optimizer_state_dict`), turned into indices in param_groups
order; ZeRO-1/2's (and older stage 3's) hold flat pieces, given back their
shapes from the shapes the checkpoint recorded.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError
from phalanx.ground.safe_files import create_file
from phalanx.train.checkpoint import hf_export
from phalanx.train.checkpoint.directory import (
    MANIFEST,
    describe_os_error,
    fsync_dir,
    list_checkpoints,
    load_file,
    replicated_file,
    verify_checkpoint,
    write_into,
)


def consolidate(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Verify `checkpoint`, write its model and optimizer whole to `out`; return them."""
    manifest = _verified(checkpoint)
    placements = manifest.get("entries", {})
    whole = {
        name: _whole(checkpoint, name, placements.get(name), manifest)
        for name in ("model", "optimizer")
    }
    write_atomically(whole, out)
    return whole


def consolidate_hf(
    checkpoint: Path, out: Path, max_shard_size: int | str = hf_export.DEFAULT_MAX_SHARD_SIZE
) -> hf_export.Written:
    """Verify `checkpoint`, write its model in Hugging Face's format into the directory
    `out` (docs/zero.md, "Consolidating"), one weight file in memory at a time."""
    hf_export.require_hf_libraries()
    manifest = _verified(checkpoint)
    source = model_source(checkpoint, manifest["entries"].get("model"))
    tied, notes = recorded_hf_files(checkpoint, manifest)
    tmp = hf_export.staging_beside(out)
    try:
        written = hf_export.write_hf(source, tmp, max_shard_size, tied, notes)
        hf_export.publish(tmp, out)
    except OSError as exc:
        hf_export.discard(tmp)
        raise hf_export.write_os_error(out, exc) from None
    except BaseException:
        hf_export.discard(tmp)
        raise
    return written


def model_source(checkpoint: Path, placement: str | None) -> hf_export.Source:
    """Where a checkpoint directory (sealed or still being written) keeps its model."""
    if placement == "replicated":
        return hf_export.TorchFileSource(checkpoint / replicated_file("model"))
    if placement == "sharded":
        from phalanx.runtime import safe_dcp

        keys = safe_dcp.read_metadata(checkpoint / "model").state_dict_metadata
        if any(key.startswith("shapes.") for key in keys):  # an older stage 3's flat pieces
            return hf_export.StateDictSource(_model(_read_dcp(checkpoint / "model")))
        return hf_export.DcpSource(checkpoint / "model")
    raise CheckpointError(
        f"{checkpoint} holds no 'model' entry (placement {placement!r}) — pass a checkpoint "
        "directory a phalanx Trainer wrote"
    )


def recorded_hf_files(
    checkpoint: Path, manifest: dict[str, Any]
) -> tuple[dict[str, str], dict[str, bytes]]:
    """The tied copies to leave out, and the config files the Trainer recorded (none for a
    plain nn.Module); only files the manifest lists (and so verified) are read."""
    listed = manifest["files"]
    notes = {n: (checkpoint / n).read_bytes() for n in hf_export.HF_NOTES if n in listed}
    tied: Any = {}
    if hf_export.TIED_NOTE in listed:
        note = checkpoint / hf_export.TIED_NOTE
        try:
            tied = json.loads(note.read_text(encoding="utf-8"))
        except ValueError:
            tied = None
        if not isinstance(tied, dict) or not all(isinstance(v, str) for v in tied.values()):
            raise CheckpointError(
                f"{note} is not a mapping of tied names — the checkpoint was changed by hand; "
                "export an earlier one, or delete the file to write every tensor"
            )
    return tied, notes


def _verified(checkpoint: Path) -> dict[str, Any]:
    found = list_checkpoints(checkpoint) if checkpoint.is_dir() else []
    if found and not (checkpoint / MANIFEST).exists():
        names = ", ".join(path.name for _, path in sorted(found))
        raise CheckpointError(
            f"{checkpoint} is a run's output_dir, and consolidate takes one checkpoint "
            f"directory — pass one of its checkpoints: {names}"
        )
    return verify_checkpoint(checkpoint)


def write_atomically(obj: Any, out: Path) -> None:
    """torch.save `obj` to a new file of a random name beside `out`, fsync it, rename it
    over `out` (a link planted at `out` is replaced, not written through).

    `out` is then either what it was before or the whole new file: a full disk
    or a kill never leaves it truncated, nor destroys a good file already there.
    Every failure is one CheckpointError line.
    """
    if out.is_dir():
        raise CheckpointError(
            f"{out} is a directory — give the output a file name, e.g. {out / 'consolidated.pt'}"
        )
    parent = out.parent
    hf_export.refuse_a_file_above(out)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create the folder for {out} ({describe_os_error(exc)}) — choose an "
            "output path whose folders are directories you can write"
        ) from None
    tmp: Path | None = None
    try:
        tmp, file = create_file(parent, f".{out.name}")  # random, O_EXCL|O_NOFOLLOW
        write_into(file, tmp, obj)
        os.replace(tmp, out)
        fsync_dir(parent)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if exc.errno == errno.ENOSPC:
            raise CheckpointError(
                f"the disk is full: cannot write {out} ({describe_os_error(exc)}) — free "
                f"space or write elsewhere; {out} was left as it was"
            ) from None
        raise CheckpointError(
            f"cannot write {out} ({describe_os_error(exc)}) — write to a folder you can write "
            f"to; {out} was left as it was"
        ) from None


def _whole(path: Path, name: str, placement: str | None, manifest: dict[str, Any]) -> Any:
    if placement == "replicated":
        return load_file(path, replicated_file(name), manifest)
    if placement == "sharded":
        saved = _read_dcp(path / name)
        return _model(saved) if name == "model" else _optimizer(saved)
    raise CheckpointError(
        f"{path} holds no {name!r} entry (placement {placement!r}) — pass a checkpoint "
        "directory a phalanx Trainer wrote"
    )


def _read_dcp(directory: Path) -> dict[str, Any]:
    """A DCP directory as one nested dict of whole tensors, read without running its pickles."""
    from phalanx.runtime import safe_dcp

    return safe_dcp.read_whole(directory)


def _shaped(value: Any, shape: list[int] | None) -> Any:
    """A flattened piece-wise tensor back in its parameter's shape (scalars stay as they are)."""
    is_flat = isinstance(value, torch.Tensor) and value.dim() == 1
    if shape is None or not is_flat or value.numel() != math.prod(shape):
        return value
    return value.reshape(shape)


def _optimizer(saved: dict[str, Any]) -> dict[str, Any]:
    if "optimizer" in saved:  # stage 3: torch's optimizer state dict, keyed by parameter name
        from phalanx.zero3.state import plain_optimizer_state

        named = saved["optimizer"]
        groups = named["param_groups"]
        if isinstance(groups, dict):
            named = {**named, "param_groups": [groups[str(g)] for g in range(len(groups))]}
        return plain_optimizer_state(named)
    shapes = saved.get("shapes", {})
    state = {
        int(i): {k: v if k == "step" else _shaped(v, shapes.get(i)) for k, v in entry.items()}
        for i, entry in saved.get("state", {}).items()
    }
    groups = saved["param_groups"]
    return {"state": state, "param_groups": [groups[str(g)] for g in range(len(groups))]}


def _model(saved: dict[str, Any]) -> dict[str, Any]:
    shapes = saved.get("shapes", {})
    return {key: _shaped(value, shapes.get(key)) for key, value in saved["model"].items()}
