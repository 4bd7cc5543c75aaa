"""An offload directory deleted under a running Trainer: one OffloadError line on every
rank (issue 36, item 11), not a raw FileNotFoundError from the step's I/O thread on the
rank whose directory went, and the others left to fail in their next collective."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from phalanx.train import Trainer
from phalanx.train.callbacks import TrainerCallback
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

DELETE_AT = 2


class _DeleteScratch(TrainerCallback):
    """Rank 0 removes its own scratch directory (as a cleanup job would) after a step."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.rank == 0 and state.global_step == DELETE_AT:
            for mine in self.scratch.glob(f"phalanx-offload-*-{os.getpid()}-rank0-*"):
                shutil.rmtree(mine)


def _train_while_deleted(rank: int, world: int, out: str) -> str:
    import phalanx

    phalanx.init(backend="gloo")
    torch.manual_seed(0)
    scratch = Path(out) / "scratch"
    args = _args(
        Path(out) / "run",
        zero_stage=1,
        max_steps=12,
        save_steps=10_000,
        zero_offload="disk",
        zero_offload_dir=str(scratch),
        zero_offload_window_mb=0.001,
    )
    trainer = Trainer(
        model=_Net(),
        args=args,
        train_dataset=_data(),
        loss_fn=_xent,
        callbacks=[_DeleteScratch(scratch)],
    )
    trainer.train()
    return "trained"


def test_a_deleted_offload_dir_is_one_line_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_workers(
        _train_while_deleted, 2, str(tmp_path), init_pg=False, allow_errors=True, timeout=120
    )
    for o in outcomes:
        assert o.error_type == "OffloadError", (o.rank, o.error_type, o.error, o.traceback)
        message = (o.error or "").strip()
        assert "the offload directory" in message and "was deleted while the run used it" in (
            message
        ), message
        assert "\n" not in message
