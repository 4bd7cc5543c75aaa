"""The DDP step benchmark runs end to end and refuses to report a reducer that skips work.

These run `benchmarks/ddp_step.py` as a user would (a subprocess with two real gloo
ranks) on the tiny models with a 2-step budget. They check what the benchmark writes,
never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ddp_step.py"
VARIANTS = ("compute", "torch_ddp", "phalanx")


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # it imports its sibling `models`
    spec = importlib.util.spec_from_file_location("ddp_step_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def run_bench(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--steps", "2", "--warmup", "1"]
    cmd += ["--timeout", "60", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.exists(), f"no JSON written; stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_run_writes_table_and_json(tmp_path: Path) -> None:
    proc, result = run_bench(tmp_path / "r.json", "--models", "mlp", "--bucket-sweep", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bucket sweep" in proc.stdout
    assert "ph÷torch" in proc.stdout and "mlp" in proc.stdout
    config = result["config"]
    assert config["world_size"] == 2 and config["threads"] == 1
    assert config["threads_seen_by_torch"] == 1 and config["omp_num_threads"] == "1"
    assert config["steps"] == 2 and config["warmup"] == 1 and config["torch_version"]
    assert config["phalanx_impl_used"] == "phalanx"
    assert list(result["models"]) == ["mlp"]
    mlp = result["models"]["mlp"]
    assert mlp["params"] == 16 * 32 + 32 + 32 * 10 + 10 and mlp["tensors"] == 4
    for variant in VARIANTS:
        timing = mlp["step_ms"][variant]
        assert timing["steps"] == 2 and timing["median_ms"] > 0
    medians = {v: mlp["step_ms"][v]["median_ms"] for v in VARIANTS}
    assert mlp["phalanx_over_torch"] == pytest.approx(medians["phalanx"] / medians["torch_ddp"])
    assert mlp["phalanx_over_compute"] == pytest.approx(medians["phalanx"] / medians["compute"])
    assert mlp["params_match"] is True and mlp["max_abs_param_diff"] <= 1e-4
    lo, hi = mlp["phalanx_over_torch_paired_ci90"]
    assert lo <= mlp["phalanx_over_torch_paired"] <= hi
    assert mlp["phalanx_over_torch_cpu"] > 0 and mlp["step_ms"]["phalanx"]["cpu_median_ms"] > 0
    assert mlp["bucket_sweep_ms"]["1"] == mlp["step_ms"]["phalanx@1"]["median_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reducer_without_communication_is_caught(tmp_path: Path) -> None:
    """Ranks that never average gradients drift apart from torch DDP: the run must fail."""
    proc, result = run_bench(tmp_path / "r.json", "--models", "cnn", "--phalanx-impl", "nocomm")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
    cnn = result["models"]["cnn"]
    assert cnn["params_match"] is False and cnn["max_abs_param_diff"] > 1e-4
    assert cnn["buffers"] > 0  # BatchNorm running stats: the buffer-broadcast path ran


@pytest.mark.slow
def test_bad_model_name_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "resnet", "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "choose from ['mlp', 'gpt', 'cnn', 'mlp50']" in proc.stderr


def test_rounds_split_steps_and_balance_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over one cycle every variant runs in every position and right after every other
    variant equally often: a rotation (B after A twice in three rounds, A after B once)
    would let what one variant leaves behind favour the next."""
    bench = load_bench(monkeypatch)
    import interleave

    for steps, rounds in [(10, 3), (7, 7), (240, 24)]:
        sizes = bench.round_sizes(steps, rounds)
        assert sum(sizes) == steps and len(sizes) == rounds
        assert max(sizes) - min(sizes) <= 1
    for n in range(1, 9):
        names = tuple(f"v{i}" for i in range(n))
        cycle = interleave.cycle_length(n)
        orders = [bench.round_order(r, names) for r in range(cycle)]
        assert all(sorted(o) == sorted(names) for o in orders)
        positions = Counter((v, i) for o in orders for i, v in enumerate(o))
        assert len(positions) == n * n and len(set(positions.values())) == 1
        follows = Counter(pair for o in orders for pair in itertools.pairwise(o))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
        assert bench.round_order(cycle, names) == orders[0]
    # Three variants: a cycle is six rounds, so 25 rounds become 30 (as long as steps allow).
    assert interleave.balanced_rounds(25, 100, 3) == 30
    assert interleave.balanced_rounds(25, 26, 3) == 25
    cfg = bench.BenchConfig(
        models=("mlp",),
        steps=100,
        warmup=0,
        rounds=25,
        threads=1,
        seed=0,
        tiny=True,
        phalanx_impl="phalanx",
        tolerance=0.0,
        bucket_sweep=("1", "5", "100", "auto"),
    )
    assert cfg.timed_rounds == 28  # 7 variants: cycles of 14


def test_paired_ratio_cancels_a_load_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine slows down 3x half-way: per-round pairing still sees phalanx = 1.1 x torch."""
    load_bench(monkeypatch)
    import step_report as bench

    torch_ms = [10.0] * 6 + [30.0] * 6
    phalanx_ms = [11.0] * 6 + [33.0] * 6
    ratios = bench.round_ratios(phalanx_ms, torch_ms, bench.round_sizes(12, 4))
    assert ratios == pytest.approx([1.1] * 4)
    assert bench.bootstrap_ci(ratios) == pytest.approx([1.1, 1.1])
    lo, hi = bench.bootstrap_ci([1.0, 1.2, 0.9, 1.1, 1.05, 0.95])
    assert 0.9 <= lo < hi <= 1.2
