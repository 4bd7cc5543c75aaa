"""`phalanx consolidate CHECKPOINT_DIR OUT.pt`: any phalanx checkpoint as one plain file.

The output is `torch.save({"model": state_dict, "optimizer": state_dict})`:
whole tensors in the plain model's keys and the plain optimizer's format, so
it loads with `torch.load(weights_only=True)` without phalanx, into the plain
model and the plain optimizer class. One process, no process group: the
sharded entries (ZeRO's optimizer, stage 3's model) are read through
torch.distributed.checkpoint's own converter, and each piece-wise tensor is
given back its shape from the shapes the checkpoint recorded.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError
from phalanx.train.checkpoint import load_file, replicated_file, verify_checkpoint


def consolidate(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Verify `checkpoint`, write its model and optimizer whole to `out`; return them."""
    manifest = verify_checkpoint(checkpoint)
    placements = manifest.get("entries", {})
    whole = {
        name: _whole(checkpoint, name, placements.get(name), manifest)
        for name in ("model", "optimizer")
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(whole, out)
    return whole


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
    """A DCP directory as one nested dict of whole tensors (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "whole.pt"
        dcp_to_torch_save(directory, target)
        loaded: dict[str, Any] = torch.load(target, weights_only=True)
    return loaded


def _shaped(value: Any, shape: list[int] | None) -> Any:
    """A flattened piece-wise tensor back in its parameter's shape (scalars stay as they are)."""
    is_flat = isinstance(value, torch.Tensor) and value.dim() == 1
    if shape is None or not is_flat or value.numel() != math.prod(shape):
        return value
    return value.reshape(shape)


def _optimizer(saved: dict[str, Any]) -> dict[str, Any]:
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
