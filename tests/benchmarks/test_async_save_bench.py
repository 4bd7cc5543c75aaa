"""benchmarks/async_save.py runs end to end and writes every figure docs/trainer.md quotes.

One stage on a tiny model, one round: what it writes, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_async_save_benchmark_reports_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "async_save.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "async_save.py"), "--tiny"]
    done = subprocess.run(
        [*command, "--stages", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    stage = result["stage 3"]
    for variant in ("sync", "async", "torch"):
        assert stage[variant]["saves"] == 1 and stage[variant]["stall_s"] > 0, stage
    for variant in ("async", "torch"):
        assert stage[variant]["stall_vs_sync"] > 0 and stage[variant]["steps_while_writing"] > 0
    staging = result["staging"]
    assert {"copy", "reused", "fork", "writer_thread", "writer_process"} <= set(staging)
