"""The accuracies the README and the examples' docstrings claim are the ones the examples print,
with their default settings, and the Trainer example does not overfit by default.

Each example runs once, whole (a few seconds of training on one process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the digits examples need scikit-learn")

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 180
# README's sentence on the digits example's figures, one process (two ranks: make demo's).
ONE_PROCESS_VECTOR = r"On one process it prints ([0-9.]+)% with torch's AVX2 or AVX-512 kernels"
ONE_PROCESS_PLAIN = r"and ([0-9.]+)% with its plain ones \(`ATEN_CPU_CAPABILITY=default`"


def _run(*command: str | Path, **extra_env: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    done = subprocess.run(
        [sys.executable, *map(str, command)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _percent(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no match for {pattern!r}"
    return float(match.group(1))


def _printed_accuracy(printed: str) -> float:
    return round(100 * _percent(r"test accuracy: ([0-9.]+)", printed), 1)


def _vector_kernels() -> bool:
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.slow  # make test-slow: full-length runs, a minute or more each
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("kernels", ["vector", "plain"])
def test_digits_prints_the_accuracy_the_readme_claims(tmp_path: Path, kernels: str) -> None:
    """README's figure with torch's AVX2/AVX-512 kernels, and the one it gives for the
    plain kernels (the probe measured 95.8% against README's 96.4%: that is where)."""
    if kernels == "vector" and not _vector_kernels():
        pytest.skip("this CPU has no AVX2: torch runs its plain kernels, the other case")
    extra = {"ATEN_CPU_CAPABILITY": "default"} if kernels == "plain" else {}
    printed = _run(ROOT / "examples" / "digits.py", "--out", tmp_path / "digits.pt", **extra)
    readme = " ".join((ROOT / "README.md").read_text().split())
    docstring = " ".join((ROOT / "examples" / "digits.py").read_text().split())
    if kernels == "vector":
        claimed = _percent(ONE_PROCESS_VECTOR, readme)
        in_docstring = _percent(r"Reaches ([0-9.]+)% test", docstring)
    else:
        claimed = _percent(ONE_PROCESS_PLAIN, readme)
        in_docstring = _percent(r"\(([0-9.]+)% where torch runs its plain kernels", docstring)
    assert _printed_accuracy(printed) == claimed == in_docstring


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_digits_figure_does_not_depend_on_the_machines_threads(tmp_path: Path) -> None:
    """The example sets its own thread count: run with 4 (what `phalanx launch` gives each
    of 2 ranks on 8 cores, or `python` on a laptop) it prints README's figure. It printed
    95.82% with 2-16 threads, against 96.4% on one (issue 35)."""
    if not _vector_kernels():
        pytest.skip("this CPU has no AVX2: README's figure for it is the plain kernels'")
    printed = _run(ROOT / "examples" / "digits.py", "--out", tmp_path / "d.pt", OMP_NUM_THREADS="4")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert _printed_accuracy(printed) == _percent(ONE_PROCESS_VECTOR, readme)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_digits_trainer_does_not_overfit_and_prints_the_accuracy_it_claims(
    tmp_path: Path,
) -> None:
    printed = _run(
        ROOT / "examples" / "digits_trainer.py",
        *("--output_dir", tmp_path, "--save_steps", "0", "--eval_steps", "100"),
        *("--report_to", "jsonl", "--disable_tqdm"),
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(eval_losses) >= 8
    # Overfitting shows as a test loss that climbs back up while the training loss falls.
    assert eval_losses[-1] <= 1.02 * min(eval_losses), eval_losses
    source = (ROOT / "examples" / "digits_trainer.py").read_text()
    claimed = _percent(r"reaches ([0-9.]+)% test accuracy\non one process", source)
    assert _printed_accuracy(printed) == claimed
