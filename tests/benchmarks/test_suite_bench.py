"""`make bench`'s suite runs end to end on tiny models and writes what docs/performance.md
quotes.

A subprocess with real gloo ranks, as a user runs it; it checks the files and
the table's arithmetic, never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "suite.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_suite_writes_table_json_and_replots(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--quick", "--worlds", "2"]
    cmd += ["--models", "mlp,cnn", "--no-startup", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "suite.json").read_text())
    assert list(result["runs"]) == ["2/mlp", "2/cnn"]
    assert result["sweep"] == ["1", "5", "100", "auto"]
    for run in result["runs"].values():
        assert run["params_match"] is True
        assert set(run["bucket_sweep_ms"]) == {"1", "5", "25", "100", "auto"}
        assert all(ms > 0 for ms in run["bucket_sweep_ms"].values())
    table = (tmp_path / "suite.md").read_text()
    assert table.count("\n| 2 | ") == 2
    median = statistics.median(r["phalanx_over_torch"] for r in result["runs"].values())
    assert f"(medians): median {median:.3f}" in table
    assert table in proc.stdout + "\n"
    # --replot reads the JSON back and writes the same table again (plots need matplotlib).
    (tmp_path / "suite.md").unlink()
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--replot", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "suite.md").read_text() == table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bucket_sweep.png").stat().st_size > 0
        assert (tmp_path / "scaling.png").stat().st_size > 0
