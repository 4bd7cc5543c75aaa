"""A Hugging Face model through the Trainer on two launched ranks.

A tiny GPT-2 is built from a config (no download) and trained on dict
batches of `input_ids` and `labels`: the Trainer must spread them into
keyword arguments (`model(**batch)`), take the loss GPT-2 returns, turn on
its gradient checkpointing, and wrap it in phalanx DDP. The loss must fall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is a test extra: pip install transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "trainer_hf.py"
RUN_TIMEOUT_S = 150


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_tiny_gpt2_learns_through_the_trainer_on_two_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_OFFLINE": "1"}
    launch = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2"]
    result_file = tmp_path / "result.json"
    done = subprocess.run(
        [*launch, str(SCRIPT), str(tmp_path / "out"), str(result_file)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(result_file.read_text())
    assert record["world_size"] == 2 and record["global_step"] == 12
    assert (record["model_class"], record["wrapped_class"]) == (
        "GPT2LMHeadModel",
        "DistributedDataParallel",
    )
    assert record["before"]["eval_samples"] == record["after"]["eval_samples"] == 21
    assert record["after"]["eval_loss"] < record["before"]["eval_loss"] - 0.5
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    train_logs = [entry for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in train_logs] == [4, 8, 12]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    assert all(entry["comm_wait_s"] >= 0 for entry in train_logs)
