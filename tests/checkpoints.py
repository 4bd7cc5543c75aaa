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


def record_loss_sums(trainer: Any) -> list[float]:
    """The Trainer's running loss sum at each log line, appended as the run goes (the list
    it returns fills in): what parity tests compare step by step."""
    sums: list[float] = []
    original = trainer.loop._log

    def log() -> None:
        original()
        sums.append(trainer.state.loss_sum)

    trainer.loop._log = log
    return sums
