"""The timeline and `phalanx bench` as a user meets them: real scripts under the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "e2e" / "scripts"
CHAR_GPT = REPO / "examples" / "char_gpt.py"
# Small enough to run in seconds, with buckets of 40 kB so that backward sends several.
SMALL_GPT = ["--steps", "4", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
             "--corpus-bytes", "40000", "--eval-windows", "4", "--sample-chars", "4",
             "--bucket-cap-mb", "0.04"]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


@pytest.mark.timeout(120)
def test_char_gpt_timeline_at_world_2_has_every_bucket_launched_inside_backward(
    tmp_path: Path,
) -> None:
    trace_path = tmp_path / "trace.json"
    argv = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2", str(CHAR_GPT),
            *SMALL_GPT, "--out", str(tmp_path / "model.pt")]  # fmt: skip
    done = subprocess.run(argv, env=_env(PHALANX_TIMELINE=str(trace_path)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads(trace_path.read_text())
    assert trace["phalanx"]["ranks"] == [0, 1]
    spans: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            spans[e["pid"], "bucket" if e["name"].startswith("bucket ") else e["name"]].append(e)
    for rank in (0, 1):
        backwards = spans[rank, "backward"]
        assert len(backwards) == 4 and len(spans[rank, "forward"]) == 4
        buckets = spans[rank, "bucket"]
        assert len(buckets) >= 4 * 3  # several buckets per step
        for step, bwd in enumerate(backwards):
            start, end = bwd["ts"], bwd["ts"] + bwd["dur"]
            nxt = backwards[step + 1]["ts"] if step + 1 < len(backwards) else float("inf")
            mine = sorted((b for b in buckets if start <= b["ts"] < nxt), key=lambda b: b["ts"])
            assert len(mine) >= 3, (rank, step)
            last = max(int(b["name"].split()[1]) for b in mine)
            for b in mine:
                if int(b["name"].split()[1]) != last:
                    assert start <= b["ts"] <= end, (rank, step, b["name"])
        steps = trace["phalanx"]["steps"][str(rank)]
        assert len(steps) == 4 and all(s["hidden_ms"] > 0 for s in steps)


def _bench(out: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """`phalanx bench` in an interpreter that must not import torch (the jobs do, it not)."""
    probe = (
        "import sys\n"
        "from phalanx.cli.main import main\n"
        f"code = main(['bench', '--nproc', '1,2', '--steps', '3', '--warmup', '1', '--out', "
        f"{str(out)!r}, *{list(flags)!r}, {str(SCRIPTS / 'bench_mlp.py')!r}])\n"
        "assert code == 0, code\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=170)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_runs_a_script_at_worlds_1_and_2_and_reports_with_reasons(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    report, stdout = _bench(out, "--no-probe")
    one, two = report["worlds"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["steps"] == two["steps"] == 3  # bench stopped the endless script
    assert one["samples_per_step"] == two["samples_per_step"] == 64
    # 74,497 float32 gradients (+ a flag slot per rank riding in the last bucket)
    assert 297_988 <= two["bytes_per_step"] <= 297_988 + 64 and two["buckets_per_step"] >= 2
    assert two["achieved_allreduce_gbps"] > 0 and two["probe_alone_ms"] is None
    assert two["efficiency"] == pytest.approx(two["throughput"] / (2 * one["throughput"]), rel=1e-6)
    assert report["recommendations"]
    assert all(r["reason"] for r in report["recommendations"])
    assert "recommendations:" in stdout and "because" in stdout
    assert (out / "bench.txt").read_text().strip() in stdout
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_probes_the_all_reduce_alone_for_the_same_buckets(tmp_path: Path) -> None:
    report, _ = _bench(tmp_path / "bench")
    two = report["worlds"][1]
    probed = {int(p["bytes"]) for p in two["probe_sizes"]}
    assert set(two["bucket_bytes"]) <= probed and two["bytes_per_step"] in probed
    assert two["probe_alone_ms"] > 0 and two["probe_allreduce_gbps"] > 0
    assert two["probe_bf16_hook_ms"] > 0  # the hook itself, on the step's bytes
