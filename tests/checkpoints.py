"""What tests that edit a checkpoint share: a manifest made to agree with the files again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def rehash(checkpoint: Path) -> None:
    """Rewrite manifest.json's file list, sizes and SHA-256s from the files now there (what
    an attacker, or a converter, does after changing them)."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        name = str(path.relative_to(checkpoint))
        if name != "manifest.json":
            data = path.read_bytes()
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["files"] = files
    manifest_path.write_text(json.dumps(manifest))


def record_losses(trainer: Any) -> list[float]:
    """The loss of each training log line (the mean step loss since the last, over every
    rank: the same on each), appended as the run goes (the list it returns fills in): what
    parity tests compare step by step. Read from the line itself: the Trainer's loss_sum
    is settled only at the end of train(), and a record of it read 0.0 at every line."""
    losses: list[float] = []
    callbacks = trainer.setup.callbacks
    original = callbacks.log

    def log(logs: dict[str, float]) -> None:
        if "loss" in logs:
            losses.append(float(logs["loss"]))
        original(logs)

    callbacks.log = log
    return losses
