"""`phalanx consolidate CHECKPOINT_DIR OUT.pt`: any phalanx checkpoint as one plain file.

The output is `torch.save({"model": state_dict, "optimizer": state_dict})`:
whole tensors in the plain model's keys and the plain optimizer's format, so
it loads with `torch.load(weights_only=True)` without phalanx, into the plain
model and the plain optimizer class. One process, no process group: the
sharded entries (ZeRO's optimizer, stage 3's model) are read through
phalanx.safe_dcp (DCP, with nothing in the files run). Stage 3's entries hold
DTensors of the whole shapes and its optimizer state keyed by parameter name
(torch's `get_optimizer_state_dict`), turned into indices in param_groups
order; ZeRO-1/2's (and older stage 3's) hold flat pieces, given back their
shapes from the shapes the checkpoint recorded.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError
from phalanx.train.checkpoint import (
    MANIFEST,
    describe_os_error,
    fsync_dir,
    list_checkpoints,
    load_file,
    replicated_file,
    verify_checkpoint,
    write_file,
)


def consolidate(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Verify `checkpoint`, write its model and optimizer whole to `out`; return them."""
    found = list_checkpoints(checkpoint) if checkpoint.is_dir() else []
    if found and not (checkpoint / MANIFEST).exists():
        names = ", ".join(path.name for _, path in sorted(found))
        raise CheckpointError(
            f"{checkpoint} is a run's output_dir, and consolidate takes one checkpoint "
            f"directory — pass one of its checkpoints: {names}"
        )
    manifest = verify_checkpoint(checkpoint)
    placements = manifest.get("entries", {})
    whole = {
        name: _whole(checkpoint, name, placements.get(name), manifest)
        for name in ("model", "optimizer")
    }
    write_atomically(whole, out)
    return whole


def write_atomically(obj: Any, out: Path) -> None:
    """torch.save `obj` to a temporary file beside `out`, fsync it, rename it over `out`.

    `out` is then either what it was before or the whole new file: a full disk
    or a kill never leaves it truncated, nor destroys a good file already there.
    Every failure is one CheckpointError line.
    """
    if out.is_dir():
        raise CheckpointError(
            f"{out} is a directory — give the output a file name, e.g. {out / 'consolidated.pt'}"
        )
    parent = out.parent
    blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(
            f"cannot write {out}: {blocking} is a file, not a directory — choose an output "
            "path whose folders are directories"
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create the folder for {out} ({describe_os_error(exc)}) — choose an "
            "output path whose folders are directories you can write"
        ) from None
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        write_file(parent, tmp.name, obj)
        os.replace(tmp, out)
        fsync_dir(parent)
    except OSError as exc:
        with contextlib.suppress(OSError):  # e.g. EROFS, even for a file never created
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
    from phalanx import safe_dcp

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
