"""benchmarks/comm_methods.py runs end to end on tiny models and reports what each method sent.

Run as a user would (a subprocess with two real gloo ranks), 16 steps. It checks
what the benchmark writes, never how fast anything was: each method's measured
bytes ratio is the one its algorithm implies, and every method ends with
identical replicas.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "comm_methods.py"
METHODS = ["fp32", "bf16", "powersgd1", "powersgd4", "local8", "diloco8"]


@pytest.mark.slow  # make test-slow: over a minute on a loaded 2-core machine
@pytest.mark.timeout(150)
def test_tiny_run_reports_every_method(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "plot.png"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--tasks", "mlp", "--steps", "16"]
    cmd += ["--longer", "local8=1.5", "--out", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| method | MB sent / step |" in proc.stdout
    mlp = json.loads(out.read_text())["tasks"]["mlp"]
    rows = mlp["methods"]
    assert list(rows) == [*METHODS, "local8@1.5x"]
    assert rows["fp32"]["compression_ratio"] >= 1.0  # the whole bucket, failure flags too
    assert rows["bf16"]["compression_ratio"] == 0.5
    assert 0 < rows["powersgd1"]["compression_ratio"] < rows["powersgd4"]["compression_ratio"] < 1
    assert rows["local8"]["compression_ratio"] == rows["diloco8"]["compression_ratio"] == 1 / 8
    for name, row in rows.items():
        assert row["replica_spread"] == 0.0, name
        evals = 3 if name == "local8@1.5x" else 2  # the longer copy: 32 steps, not 16
        assert row["curve"][0][0] == 0.0 and len(row["curve"]) == evals, name
    assert rows["fp32"]["wall_to_fp32_final_vs_fp32"] == 1.0
    assert 0 < mlp["optimum"] < rows["fp32"]["final_val_loss"]
    assert png.exists() or "matplotlib is not installed" in proc.stdout
