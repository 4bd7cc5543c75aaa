"""Through the Trainer: a meta-built model with one tensor left on meta beside loaded ones
keeps the loaded values, at stage 0 and at stage 3, where the loaded tensors are shards
when `materialize` runs (issue 36, item 9; the single-process case is
tests/unit/test_meta_partial.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx import zero3
from phalanx.train import Trainer
from tests.distributed.test_meta_init import _Stack
from tests.distributed.test_trainer_zero import _args, _data, _xent
from tests.harness import run_workers

MISSING = "head.bias"


def _loaded() -> dict[str, torch.Tensor]:
    torch.manual_seed(21)
    return {k: v for k, v in _Stack().state_dict().items() if k != MISSING}


def _initial(rank: int, world: int, out: str, stage: int) -> dict[str, Any]:
    loaded = _loaded()
    torch.manual_seed(5 if rank == 0 else 900)  # only rank 0's generator may count
    with torch.device("meta"):
        model = _Stack()
    model.load_state_dict(loaded, strict=False, assign=True)
    args = _args(Path(out), zero_stage=stage, max_steps=1, save_steps=10_000)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), loss_fn=_xent)
    full = (
        zero3.full_state_dict(trainer.model, to=0)
        if stage == 3
        else {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    )
    trainer.close()
    if full is None:
        return {}
    return {
        "kept": [k for k, v in loaded.items() if torch.equal(full[k].cpu(), v)],
        "drawn_again": [k for k, v in loaded.items() if not torch.equal(full[k].cpu(), v)],
        "missing_set": bool(torch.isfinite(full[MISSING]).all()),
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 3])
def test_the_trainer_initialises_only_what_is_still_meta(tmp_path: Path, stage: int) -> None:
    outcomes = run_workers(_initial, 2, str(tmp_path), stage, init_pg=False, timeout=120)
    got = outcomes[0].value
    assert got["drawn_again"] == [], got
    assert got["missing_set"] and len(got["kept"]) == len(_loaded())
