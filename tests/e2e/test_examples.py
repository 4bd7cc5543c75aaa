"""The examples, run as a user runs them: one process, `phalanx launch`, and torchrun.

Each run uses a short budget and is bounded by a subprocess timeout, so a hang
fails the test instead of stalling the suite. We assert on what the scripts
print: the metric, the throughput, the replica check, and that rank 0 alone
reports and saves.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

needs_sklearn = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None,
    reason="the digits examples need scikit-learn: pip install -e '.[examples]'",
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT_S = 120

LAUNCHERS = {
    "single": [sys.executable],
    "phalanx": [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2"],
    # --standalone picks a free port, so parallel test runs do not collide on 29500.
    "torchrun": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ],
}
SHORT = {
    "digits.py": ["--steps", "100"],
    "cnn_digits.py": ["--steps", "60"],
    "char_gpt.py": [
        "--steps", "30", "--eval-interval", "15", "--n-layer", "1", "--n-head", "2",
        "--n-embd", "32", "--block-size", "64", "--batch-size", "16",
        "--corpus-bytes", "200000", "--eval-windows", "32", "--sample-chars", "40",
    ],
}  # fmt: skip


@cache
def run_example(script: str, launcher: str, out_dir: str) -> str:
    """Run one example once (tests share the result) and return what it printed."""
    out = Path(out_dir) / f"{launcher}-{script}.pt"
    cmd = [*LAUNCHERS[launcher], str(EXAMPLES / script), *SHORT[script], "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{printed}"
    assert out.exists() and not out.with_suffix(".pt.partial").exists(), printed
    torch.load(out, weights_only=True)  # a complete checkpoint, loadable safely
    return printed


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("examples"))


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return float(match.group(1).replace(",", ""))


def _rank0_only(printed: str, marker: str) -> None:
    assert printed.count(marker) == 1, f"{marker!r} should be printed by rank 0 alone:\n{printed}"


def _digits_losses(printed: str) -> list[float]:
    return [float(v) for v in re.findall(r"train loss (\d+\.\d+)", printed)]


@needs_sklearn
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("single", marks=pytest.mark.slow),
        "phalanx",
        pytest.param("torchrun", marks=pytest.mark.slow),
    ],
)
def test_digits_learns_and_replicas_agree(launcher: str, out_dir: str) -> None:
    printed = run_example("digits.py", launcher, out_dir)
    assert _number(r"test accuracy: (\d\.\d+)", printed) >= 0.9
    assert _number(r"throughput: ([\d,]+) samples/s", printed) > 0
    assert "replicas identical: yes (max |diff| 0)" in printed
    assert f"world size {1 if launcher == 'single' else 2}," in printed
    _rank0_only(printed, "test accuracy:")
    _rank0_only(printed, "saved ")


@pytest.mark.slow
@needs_sklearn
@pytest.mark.timeout(300)
def test_digits_on_two_ranks_trains_like_one_process(out_dir: str) -> None:
    """Same global batch, split over two ranks, averaged: the same training run."""
    one = run_example("digits.py", "single", out_dir)
    two = run_example("digits.py", "phalanx", out_dir)
    assert _digits_losses(one) == pytest.approx(_digits_losses(two), abs=1e-3)
    accuracy = r"test accuracy: (\d\.\d+)"
    assert _number(accuracy, one) == pytest.approx(_number(accuracy, two), abs=0.01)


@pytest.mark.slow
@needs_sklearn
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", [pytest.param("single", marks=pytest.mark.slow), "phalanx"])
def test_cnn_digits_keeps_batchnorm_buffers_in_sync(launcher: str, out_dir: str) -> None:
    printed = run_example("cnn_digits.py", launcher, out_dir)
    assert _number(r"test accuracy: (\d\.\d+)", printed) >= 0.9
    assert _number(r"throughput: ([\d,]+) samples/s", printed) > 0
    # the check covers BatchNorm's running statistics, which only the broadcast syncs
    assert "replicas identical: yes (max |diff| 0)" in printed
    _rank0_only(printed, "saved ")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", [pytest.param("single", marks=pytest.mark.slow), "phalanx"])
def test_char_gpt_validation_loss_falls(launcher: str, out_dir: str) -> None:
    printed = run_example("char_gpt.py", launcher, out_dir)
    val = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", printed)]
    assert len(val) == 3, printed  # before training, and at steps 15 and 30
    assert val[0] > val[1] > val[2], f"validation loss did not fall: {val}"
    assert "validation loss fell" in printed
    assert _number(r"\| ([\d,]+) tokens/s", printed) > 0
    assert re.search(r"sample:\n(\[rank 0\] )?def ", printed), printed  # launch prefixes lines
    _rank0_only(printed, "sample:")
