"""Exact resume, as a user meets it: a launched job is SIGKILLed and started again.

The central promise: a two-rank job with dropout and shuffled data that is
killed mid-run and resumed with `resume_from_checkpoint=True` ends with the
very same parameters (bit for bit) as the job that was never interrupted.
Run A goes under torchrun, run B under `phalanx launch`, so both launchers
are covered. The remaining tests exercise checkpoint files directly in one
plain process (no launcher: a one-rank group, no DDP), which is fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.train import (
    CheckpointError,
    CheckpointFallbackWarning,
    IncompleteSaveWarning,
    Trainer,
    TrainingArguments,
)
from phalanx.train.checkpoint.directory import MANIFEST

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "trainer_resume.py"
RUN_TIMEOUT_S = 120
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
PHALANX = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2"]


def _run(launcher: list[str], *script_args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [*launcher, str(SCRIPT), *map(str, script_args)]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO
    )


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow  # make test-slow: the restart test below (stage 3) covers kill + resume
@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 30)
def test_a_job_killed_mid_run_resumes_to_bit_identical_parameters(tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _ok(_run(TORCHRUN, whole, tmp_path / "a.pt"))

    killed = _run(
        PHALANX, broken, tmp_path / "b.pt", "--save-steps", "5", "--kill-after-step", "13"
    )
    assert killed.returncode != 0, "the SIGKILL at step 13 should have failed the job"
    assert "SIGKILL" in killed.stdout + killed.stderr
    # checkpoint-10 is written in the background (save_async): the kill 3 steps later may
    # land before it is in place, and then the resume goes on from checkpoint-5.
    kept = sorted(p.name for p in broken.glob("checkpoint-*") if ".tmp" not in p.name)
    assert kept in (["checkpoint-10", "checkpoint-5"], ["checkpoint-5"])
    newest = broken / ("checkpoint-10" if "checkpoint-10" in kept else "checkpoint-5")

    _ok(_run(PHALANX, broken, tmp_path / "b.pt", "--save-steps", "5", "--resume"))
    summary = json.loads((tmp_path / "b.json").read_text())
    assert (summary["global_step"], summary["resumed_from"]) == (20, str(newest))
    whole_loss = json.loads((tmp_path / "a.json").read_text())["train_loss"]
    assert summary["train_loss"] == pytest.approx(whole_loss, rel=1e-6)  # the mean since step 0
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The killed run logged step 12 past its checkpoint; the resumed run logged it again,
    # and the file keeps one line per step.
    logged = [json.loads(line)["step"] for line in (broken / "metrics.jsonl").open()]
    assert logged == [4, 8, 12, 16, 20]


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]
)
def test_the_launcher_restarts_a_killed_job_and_it_ends_bit_identical(
    tmp_path: Path, stage: int
) -> None:
    """Lose a worker without losing the run: --max-restarts plus resume_from_checkpoint=True.

    Under ZeRO too (stages 1 to 3): the optimizer state (and under stage 3 the
    model's pieces) come back from the shards every rank wrote through
    torch.distributed.checkpoint.
    """
    whole, restarted = tmp_path / "whole", tmp_path / "restarted"
    zero = ("--zero-stage", str(stage))
    _ok(_run(PHALANX, whole, tmp_path / "a.pt", *zero))
    launcher = [*PHALANX[:-2], "--max-restarts", "1", *PHALANX[-2:]]
    run = _run(
        launcher,
        *(restarted, tmp_path / "b.pt", "--save-steps", "5", "--resume", *zero),
        *("--kill-after-step", "13", "--kill-on-first-attempt-only"),
    )
    _ok(run)
    printed = run.stdout + run.stderr
    assert "SIGKILL" in printed, "the first attempt should have been killed"
    # What rank 0 tells the console: 8 steps per epoch, so step 10 is 2 steps (4
    # micro-batches of 4 samples on 2 ranks) into epoch 1.
    assert "saved checkpoint-5 (" in printed
    assert "restart 1 of 1: resuming…" in printed
    # checkpoint-10 is written in the background: a kill before it is in place resumes
    # from checkpoint-5.
    resumed = {
        "checkpoint-10": "resumed from checkpoint-10 (step 10, epoch 1, sample 32 of the epoch)",
        "checkpoint-5": "resumed from checkpoint-5 (step 5, epoch 0, sample 80 of the epoch)",
    }
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["global_step"] == 20
    newest = Path(summary["resumed_from"]).name
    assert resumed[newest] in printed, printed
    assert summary["resumed_from"] == str(restarted / newest)
    entries = json.loads((restarted / "checkpoint-20" / MANIFEST).read_text())["entries"]
    assert entries["optimizer"] == ("sharded" if stage else "replicated")
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------ one plain process


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 4, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _trainer(out: Path, **overrides: Any) -> Trainer:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 6,
        "save_steps": 2,
        "per_device_train_batch_size": 8,
        "report_to": [],
        "disable_tqdm": True,
        **overrides,
    }
    return Trainer(
        model=_Net(), args=TrainingArguments(**settings), train_dataset=_data(), loss_fn=_xent
    )


def test_checkpoints_are_complete_directories_and_rotate(tmp_path: Path) -> None:
    _trainer(tmp_path, save_total_limit=2).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    newest = tmp_path / "checkpoint-6"
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["entries"] == {
        "trainer": "replicated",
        "model": "replicated",
        "optimizer": "replicated",
        "scheduler": "replicated",
        "sampler": "replicated",
        "rng": "per_rank",
    }
    assert sorted(manifest["files"]) == [
        "args.json",
        "model.pt",
        "optimizer.pt",
        "rng/rank-00000.pt",
        "sampler.pt",
        "scheduler.pt",
        "trainer.pt",
    ]
    state = torch.load(newest / "trainer.pt", weights_only=True)
    assert (state["global_step"], state["world_size"]) == (6, 1)
    assert state["args"]["save_total_limit"] == 2


def test_resume_true_with_no_checkpoint_starts_afresh_and_skips_torn_ones(tmp_path: Path) -> None:
    torn = tmp_path / "checkpoint-4.tmp"
    torn.mkdir(parents=True)
    (torn / "model.pt").write_bytes(b"half")
    with pytest.warns(IncompleteSaveWarning, match="checkpoint-4 was never completed"):
        out = _trainer(tmp_path, save_steps=0).train(resume_from_checkpoint=True)
    assert (out.resumed_from, out.global_step) == (None, 6)
    assert not torn.exists()  # a .tmp directory never finished: it is swept away, and said


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path: Path) -> None:
    _trainer(tmp_path).train()
    model_file = tmp_path / "checkpoint-6" / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        _trainer(tmp_path, max_steps=8).train(resume_from_checkpoint=tmp_path / "checkpoint-6")
    with pytest.warns(CheckpointFallbackWarning, match="checkpoint-6"):
        out = _trainer(tmp_path, max_steps=8).train(resume_from_checkpoint=True)
    assert out.resumed_from == str(tmp_path / "checkpoint-4")


def test_a_checkpoint_without_its_manifest_is_incomplete(tmp_path: Path) -> None:
    _trainer(tmp_path, max_steps=2).train()
    (tmp_path / "checkpoint-2" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="never completed"):
        _trainer(tmp_path).train(resume_from_checkpoint=tmp_path / "checkpoint-2")
    with pytest.raises(CheckpointError, match="none is valid"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)


def test_a_checkpoint_with_unsafe_pickles_is_refused_by_weights_only(tmp_path: Path) -> None:
    """Files are checked against the manifest, then loaded with weights_only=True."""
    _trainer(tmp_path, max_steps=2).train()
    path = tmp_path / "checkpoint-2"
    torch.save({"hook": print}, path / "scheduler.pt")  # a callable: not weights-only data
    manifest = json.loads((path / MANIFEST).read_text())
    blob = (path / "scheduler.pt").read_bytes()
    entry = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    manifest["files"]["scheduler.pt"] = entry
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weights_only"):
        _trainer(tmp_path).train(resume_from_checkpoint=path)


def test_train_loss_is_the_runs_mean_and_a_finished_run_has_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _trainer(tmp_path, report_to=["jsonl"], logging_steps=1).train()
    logged = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open()]
    assert len(logged) == 6
    assert out.train_loss == pytest.approx(sum(logged) / 6, rel=1e-6)  # not the last step's
    again = _trainer(tmp_path, report_to=["jsonl"]).train(resume_from_checkpoint=True)
    assert (again.global_step, again.train_loss) == (6, pytest.approx(out.train_loss, rel=1e-12))
    printed = capsys.readouterr().out
    assert "saved checkpoint-6 (" in printed and " kB, " in printed
    assert "resumed from checkpoint-6 (step 6, epoch 1, sample 8 of the epoch)" in printed
    assert "already at max_steps (6) — nothing to do" in printed
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6  # left as it was


class _Crash(Exception):
    pass


def test_a_plain_process_resumes_exactly_too(tmp_path: Path) -> None:
    reference = _trainer(tmp_path / "whole", gradient_accumulation_steps=2)
    reference.train()
    crashing = _trainer(tmp_path / "split", gradient_accumulation_steps=2)

    def crash_after_step_5(outputs: Tensor, batch: list[Tensor]) -> Tensor:
        if crashing.state.global_step == 5:
            raise _Crash
        return _xent(outputs, batch)

    crashing.loss_fn = crash_after_step_5
    with pytest.raises(_Crash):
        crashing.train()
    resumed = _trainer(tmp_path / "split", gradient_accumulation_steps=2)
    out = resumed.train(resume_from_checkpoint=True)
    assert (out.resumed_from, out.global_step) == (str(tmp_path / "split" / "checkpoint-4"), 6)
    for ours, theirs in zip(resumed.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------------ the examples


def _example(name: str, *flags: str) -> str:
    command = [sys.executable, str(REPO / "examples" / name), "--disable_tqdm", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_the_digits_example_continues_where_it_stopped(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="examples/digits.py needs scikit-learn")
    common = ("--output_dir", str(tmp_path), "--save_steps", "10", "--eval_steps", "0")
    first = _example("digits_trainer.py", *common, "--max_steps", "20")
    assert f"checkpoint: {tmp_path / 'checkpoint-20'}" in first
    assert f"metrics: {tmp_path / 'metrics.jsonl'}" in first
    second = _example("digits_trainer.py", *common, "--max_steps", "30")
    assert f"resumed from: {tmp_path / 'checkpoint-20'}" in second
    assert "step 30," in second and "test accuracy:" in second


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_char_gpt_example_trains_on_dict_batches(tmp_path: Path) -> None:
    out = _example(
        "char_gpt_trainer.py",
        *("--output_dir", str(tmp_path), "--max_steps", "4", "--save_steps", "4"),
        *("--corpus_bytes", "20000", "--sample", "10", "--gradient_checkpointing"),
        *("--report_to", "console", "csv"),
    )
    assert "step 4," in out and "eval loss" in out
    assert f"checkpoint: {tmp_path / 'checkpoint-4'}" in out
    assert f"metrics: {tmp_path / 'metrics.csv'}" in out
