"""`phalanx consolidate` turns every kind of Trainer checkpoint into one plain file.

A 2-rank Trainer run saves at zero_stage 0, 1, 2 and 3. The consolidated file
must load with `torch.load(weights_only=True)` into the plain model and a
plain AdamW with the Trainer's two groups (every parameter's state whole), and
hold exactly the state the ranks had (gathered by the ranks themselves).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx import zero3
from phalanx.train import Trainer
from phalanx.train.checkpoint.consolidate import consolidate
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.distributed.test_zero_state import _same
from tests.harness import run_workers

STAGES = (0, 1, 2, 3)


def _train(rank: int, world_size: int, root: str) -> None:
    phalanx.init(backend="gloo")
    for stage in STAGES:
        out = Path(root) / f"stage{stage}"
        args = _args(out, zero_stage=stage, max_steps=3, save_steps=3)
        trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
        trainer.train()
        opt: Any = trainer.optimizer
        if stage == 3:
            model, optim = (
                zero3.full_state_dict(trainer.model),
                zero3.full_optimizer_state_dict(trainer.model, opt),
            )
        elif stage:
            opt.consolidate_state_dict(to=0)
            model, optim = trainer.model.state_dict(), opt.state_dict() if rank == 0 else None
        else:
            model, optim = trainer.model.state_dict(), opt.state_dict()
        if rank == 0:
            torch.save({"model": model, "optimizer": optim}, out / "reference.pt")


def _plain_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest}])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("consolidate")
    run_workers(_train, 2, str(root), init_pg=False, timeout=150)
    return root


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", STAGES)
def test_every_checkpoint_becomes_one_plain_file(checkpoints: Path, stage: int) -> None:
    out = checkpoints / f"stage{stage}.pt"
    consolidate(checkpoints / f"stage{stage}" / "checkpoint-3", out)
    whole = torch.load(out, weights_only=True)
    reference = torch.load(checkpoints / f"stage{stage}" / "reference.pt", weights_only=True)
    assert _same(whole["model"], reference["model"])
    assert _same(whole["optimizer"], reference["optimizer"])
    model = _Net()
    model.load_state_dict(whole["model"])
    optimizer = _plain_adamw(model)
    optimizer.load_state_dict(whole["optimizer"])
    for p in model.parameters():
        assert optimizer.state[p]["exp_avg"].shape == p.shape


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_command_line_writes_the_file(checkpoints: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "consolidate",
            str(checkpoints / "stage3" / "checkpoint-3"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(torch.load(out, weights_only=True)) == {"model", "optimizer"}
