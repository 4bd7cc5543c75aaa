"""What the Trainer writes, on two real ranks: an old run's directory, a bad manifest, a full
disk and a read-only output_dir each fail as one clear error on every rank.

The full disk is real: a 4 MiB tmpfs that rank 0 fills mid-run, so the next
write meets ENOSPC from the kernel. The read-only directory is a tmpfs
mounted read-only (root ignores file modes), or a directory without write
permission for other users. Mounting needs root; without it those tests skip.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.errors import CheckpointError, ConfigurationError, OutputError
from phalanx.train import CheckpointFallbackWarning, ResumeWarning, Trainer, TrainingArguments
from phalanx.train.checkpoint.directory import MANIFEST, verify_checkpoint
from tests.disks import fill
from tests.harness import run_workers

CORRUPT = "the checkpoint is corrupt; resume from an earlier one"
_RANK_PREFIX = re.compile(r"^rank \d+: ")


class _OnFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=gen)
    return TensorDataset(x, torch.randint(0, 3, (64,), generator=gen))


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _trainer(out_dir: Path, loss_fn: Any = _xent, **overrides: Any) -> Trainer:
    settings: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps": 4,
        "save_steps": 2,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "report_to": [],
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 60,
        **overrides,
    }
    args = TrainingArguments(**settings)
    return Trainer(model=_OnFirst(), args=args, train_dataset=_data(), loss_fn=loss_fn)


def _error_of(run: Any) -> str:
    """ "Kind: message"; the ranks that did not fail themselves prefix "rank 0: ", dropped here
    so every rank's text compares equal."""
    try:
        run()
    except (CheckpointError, ConfigurationError, OutputError) as exc:
        message = _RANK_PREFIX.sub("", str(exc))
        return f"{type(exc).__name__}: {message}"
    return "no error"


# --------------------------------------------------------- an old run's directory


def _old_directory(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    phalanx.init(backend="gloo")  # one group for every Trainer of this worker
    out = Path(out_dir)
    _trainer(out).train()  # leaves checkpoint-2 and checkpoint-4
    steps: list[int] = []

    def counting(outputs: Tensor, batch: list[Tensor]) -> Tensor:
        steps.append(1)
        return _xent(outputs, batch)

    result: dict[str, Any] = {"fresh": _error_of(lambda: _trainer(out, counting).train())}
    result["trained_before_the_error"] = len(steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(out, max_steps=6, learning_rate=2e-3, seed=7).train(resume_from_checkpoint=True)
    result["warnings"] = [str(w.message) for w in caught if w.category is ResumeWarning]
    _trainer(out, max_steps=2, overwrite_output_dir=True).train()
    dist.barrier()
    result["left"] = sorted(p.name for p in out.iterdir())
    return result


@pytest.mark.timeout(120)
def test_a_fresh_run_refuses_an_old_runs_checkpoints_unless_told(tmp_path: Path) -> None:
    outs = run_workers(_old_directory, 2, str(tmp_path), init_pg=False)
    for out in outs:
        value = out.value
        assert value["fresh"].startswith("ConfigurationError: ")
        assert "already holds checkpoints (the newest is checkpoint-4)" in value["fresh"]
        assert "resume_from_checkpoint=True" in value["fresh"]
        assert "overwrite_output_dir=True" in value["fresh"]
        assert value["trained_before_the_error"] == 0
        # overwrite_output_dir deleted checkpoint-4 and -6 before writing checkpoint-2 again
        assert value["left"] == ["checkpoint-2"]
    (warning,) = outs[0].value["warnings"]  # rank 0 warns, once
    assert "learning_rate 0.001 → 0.002, seed 42 → 7" in warning
    assert "the saved optimizer and scheduler keep the checkpoint's learning_rate" in warning
    assert "epoch 0 continues at sample 32 of 64" in warning
    assert outs[1].value["warnings"] == []


# --------------------------------------------------------------- a bad manifest


def _bad_manifests(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    phalanx.init(backend="gloo")
    result: dict[str, Any] = {}
    for case in ("no-bytes", "truncated"):
        out = Path(out_dir) / case
        _trainer(out).train()
        newest = out / "checkpoint-4"
        if rank == 0:
            if case == "no-bytes":  # valid JSON, an entry without "bytes"
                manifest = json.loads((newest / MANIFEST).read_text())
                del manifest["files"]["model.pt"]["bytes"]
                (newest / MANIFEST).write_text(json.dumps(manifest))
            else:
                model = newest / "model.pt"
                model.write_bytes(model.read_bytes()[:100])
        dist.barrier()
        result[f"{case}/explicit"] = _error_of(
            lambda out=out, newest=newest: _trainer(out, max_steps=6).train(newest)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _trainer(out, max_steps=6).train(resume_from_checkpoint=True)
        result[f"{case}/resumed_from"] = Path(run.resumed_from or "none").name
        result[f"{case}/warnings"] = [
            str(w.message) for w in caught if w.category is CheckpointFallbackWarning
        ]
    return result


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_malformed_manifest_is_a_corrupt_checkpoint_like_a_truncated_file(
    tmp_path: Path,
) -> None:
    outs = run_workers(_bad_manifests, 2, str(tmp_path), init_pg=False)
    assert outs[0].value["no-bytes/explicit"] == outs[1].value["no-bytes/explicit"]
    for out in outs:
        for case in ("no-bytes", "truncated"):
            message = out.value[f"{case}/explicit"]
            assert message.startswith("CheckpointError: ") and message.endswith(CORRUPT)
            assert "checkpoint-4" in message
            assert out.value[f"{case}/resumed_from"] == "checkpoint-2"
        assert (
            """the entry for 'model.pt' lacks "sha256" or "bytes\""""
            in (out.value["no-bytes/explicit"])
        )
    for case in ("no-bytes", "truncated"):
        (warning,) = outs[0].value[f"{case}/warnings"]
        assert "skipping a checkpoint that failed verification" in warning
        assert CORRUPT in warning and "resuming from" in warning


# ------------------------------------------------------ a full or read-only disk


def _filling_after(step: int, disk: Path, rank: int, trainer_box: list[Trainer]) -> Any:
    def loss(outputs: Tensor, batch: list[Tensor]) -> Tensor:
        filled = (disk / "filler").exists()
        if rank == 0 and trainer_box[0].state.global_step == step and not filled:
            fill(disk)
        return _xent(outputs, batch)

    return loss


def _full_disk_on_save(rank: int, world: int, disk: str, stage: int) -> dict[str, Any]:
    phalanx.init(backend="gloo")
    out = Path(disk) / "run"
    box: list[Trainer] = []
    # Saves written there and then: the disk fills once checkpoint-2 is in place (a
    # background write of it could meet the full disk too: tests/faults/test_async_faults.py).
    filling = _filling_after(2, Path(disk), rank, box)
    box.append(_trainer(out, filling, zero_stage=stage, save_async=False))
    result: dict[str, Any] = {"error": _error_of(box[0].train)}
    dist.barrier()
    result["left"] = sorted(p.name for p in out.iterdir())
    if rank == 0:
        verify_checkpoint(out / "checkpoint-2")  # raises if the previous one was harmed
        (Path(disk) / "filler").unlink()
    dist.barrier()
    resumed = _trainer(out, zero_stage=stage).train(resume_from_checkpoint=True)
    result["resumed"] = (Path(resumed.resumed_from or "none").name, resumed.global_step)
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(
    small_disk: Path, stage: int
) -> None:
    outs = run_workers(_full_disk_on_save, 2, str(small_disk), stage, init_pg=False)
    for out in outs:
        error = out.value["error"]
        assert error.startswith("CheckpointError: "), error
        assert "could not write checkpoint-4: " in error and "no space left on device" in error
        assert "unexpected pos" not in error and "checkpoint-2 is intact" in error
        staging = re.escape(str(small_disk / "run" / "checkpoint-4.")) + r"[0-9a-f]{12}\.tmp"
        if stage == 0:  # rank 0's own file, named
            assert re.search(staging, error), error
        else:  # DCP: every rank's shards
            assert "rank(s) [0, 1] could not write their shards (" in error
            assert re.search(staging + "/optimizer", error), error
        assert out.value["left"] == ["checkpoint-2"]  # the partial .tmp is gone
        assert out.value["resumed"] == ("checkpoint-2", 4)


def _full_disk_on_metrics(rank: int, world: int, disk: str) -> dict[str, Any]:
    out = Path(disk) / "run"
    box: list[Trainer] = []
    loss = _filling_after(2, Path(disk), rank, box)
    box.append(
        _trainer(out, loss, max_steps=200, save_steps=0, report_to=["jsonl"], logging_steps=1)
    )
    error = _error_of(box[0].train)
    return {"error": error, "step": box[0].state.global_step}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_full_disk_while_writing_metrics_fails_on_every_rank(small_disk: Path) -> None:
    outs = run_workers(_full_disk_on_metrics, 2, str(small_disk), init_pg=False)
    for out in outs:
        error = out.value["error"]
        jsonl = small_disk / "run" / "metrics.jsonl"
        assert error.startswith(f"OutputError: could not write {jsonl}: no space left on device")
        assert 2 < out.value["step"] < 200
    assert outs[0].value["step"] == outs[1].value["step"]


def _read_only(rank: int, world: int, where: str) -> list[str]:
    phalanx.init(backend="gloo")
    out = Path(where) / "run"
    steps: list[int] = []

    def counting(outputs: Tensor, batch: list[Tensor]) -> Tensor:
        steps.append(1)
        return _xent(outputs, batch)

    checkpoints_only = _error_of(_trainer(out, counting).train)
    metrics_only = _error_of(_trainer(out, counting, save_steps=0, report_to=["jsonl"]).train)
    return [checkpoints_only, metrics_only, f"steps {len(steps)}"]


@pytest.mark.timeout(120)
def test_an_output_dir_that_cannot_be_written_fails_before_training(read_only_dir: Path) -> None:
    outs = run_workers(_read_only, 2, str(read_only_dir), init_pg=False)
    reason = "read-only file system" if os.geteuid() == 0 else "permission denied"
    for out in outs:
        *errors, steps = out.value
        for error in errors:
            assert error.startswith(f"OutputError: output_dir={read_only_dir / 'run'} cannot be")
            assert reason in error and " — pass an output_dir you can write to" in error
        assert steps == "steps 0"
