"""A checkpoint's manifest is checked before anything trusts it, with or without `python -O`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.train.checkpoint.directory import (
    MANIFEST,
    CheckpointError,
    verify_checkpoint,
    write_checkpoint,
)

_ENTRY = {"sha256": "ab", "bytes": 3}
BAD_MANIFESTS: list[tuple[Any, str]] = [
    ([1, 2], 'no "files" mapping'),
    ({"format": 1}, 'no "files" mapping'),
    ({"files": ["model.pt"]}, 'no "files" mapping'),
    ({"format": 2, "files": {"model.pt": "abc"}}, "the entry for 'model.pt'"),
    ({"format": 2, "files": {"model.pt": {"sha256": "ab"}}}, "the entry for 'model.pt'"),
    ({"format": 2, "files": {"model.pt": {"sha256": "ab", "bytes": "3"}}}, "the entry for"),
    ({"format": 1, "files": {}}, "checkpoint format 1, and this phalanx reads format 2"),
    ({"format": 2, "files": {"../x.pt": _ENTRY}}, "'../x.pt' points outside the checkpoint"),
    ({"format": 2, "files": {"/etc/x": _ENTRY}}, "'/etc/x' points outside the checkpoint"),
    ({"format": 2, "files": {}}, 'no "entries" mapping'),
    ({"format": 2, "files": {}, "entries": {"model": "everywhere"}}, "unknown placement"),
    (
        {"format": 2, "files": {}, "entries": {"model": "replicated"}},
        "entry 'model' (replicated) has no model.pt among its files",
    ),
    (
        {"format": 2, "files": {"model.pt": _ENTRY}, "entries": {"opt": "sharded"}},
        "entry 'opt' (sharded) has no opt/.metadata among its files",
    ),
]


@pytest.mark.parametrize(("manifest", "message"), BAD_MANIFESTS)
def test_a_malformed_manifest_is_a_checkpoint_error(
    tmp_path: Path, manifest: Any, message: str
) -> None:
    path = write_checkpoint(tmp_path, 1, {"model.pt": b"abc"})
    assert verify_checkpoint(path)["files"]["model.pt"]["bytes"] == 3
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is corrupt; resume from an earlier one") as raised:
        verify_checkpoint(path)
    assert message in str(raised.value)


@pytest.mark.slow
def test_the_manifest_check_survives_python_dash_o(tmp_path: Path) -> None:
    """-O strips asserts: the check must not be one."""
    path = write_checkpoint(tmp_path, 1, {"model.pt": b"abc"})
    (path / MANIFEST).write_text(json.dumps({"files": []}))
    code = (
        "import sys\n"
        "from phalanx.train.checkpoint.directory import CheckpointError, verify_checkpoint\n"
        "try:\n"
        f"    verify_checkpoint(__import__('pathlib').Path({str(path)!r}))\n"
        "except CheckpointError:\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, timeout=90)
    assert done.returncode == 0, done.stderr.decode()
