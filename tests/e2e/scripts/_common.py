"""Helpers shared by the worker scripts the launcher tests start (no torch: they start fast)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def rank() -> int:
    return int(os.environ["RANK"])


def wait_for_files(paths: list[Path], timeout_s: float = 20.0) -> None:
    """Block until every path exists, so a failure is staged only once its peers are ready."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers never wrote {[str(p) for p in paths]}")
        time.sleep(0.02)


def write_atomically(path: Path, text: str) -> None:
    """Readers poll for the file; they must never see it half written."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
