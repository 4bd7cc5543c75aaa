"""benchmarks/gpu_check.py, on this machine without a GPU: every row of its table names a
test that exists (a renamed one would say "not run"), each is skipped with pytest's
reason, and the script exits 0; on a machine with CUDA the same rows must pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_every_row_runs_its_test(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    script = ROOT / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=580)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 9 and "gpu check:" in done.stdout
    expected = "passed" if torch.cuda.is_available() else "skipped"
    assert {r["result"] for r in rows} == {expected}, rows
    if expected == "skipped":
        assert all("CUDA" in r["why"] for r in rows), rows
