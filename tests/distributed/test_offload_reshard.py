"""Checkpoints of offloaded runs are ordinary checkpoints: they reshard, they load with or
without offload, and `phalanx consolidate` reads them (issue 23, "Checkpoints and resume").

At zero_stage 1 and 3, world 2 trains 5 steps with `zero_offload="disk"` (and,
beside it, without), saving checkpoint-5. Each load below resumes a
checkpoint with max_steps at its step (nothing left to train) and gathers the
whole state it holds, which must be exactly what `phalanx consolidate` makes
of that checkpoint (parameters and AdamW state, as whole tensors):

- offloaded -> not offloaded and not offloaded -> offloaded, at world 2;
- (slow) offloaded world 2 -> offloaded world 3, which trains on to step 8 and
  saves; that checkpoint -> offloaded world 2.

And consolidate of the offloaded world-2 checkpoint must be exactly the state
the ranks held when they saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from phalanx import zero3
from phalanx.train import Trainer
from phalanx.train.checkpoint.consolidate import consolidate
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.distributed.test_zero_state import _same
from tests.harness import run_workers

Run = tuple[str, bool, int, str | None]
"""(name, offloaded, max_steps, the checkpoint to resume, relative to the stage's root)."""


def _consolidated(trainer: Trainer, stage: int) -> dict[str, Any] | None:
    """The whole model and optimizer state, gathered by the ranks (on rank 0)."""
    optimizer: Any = trainer.optimizer
    if stage == 3:
        model = zero3.full_state_dict(trainer.model, to=0)
        optim = zero3.full_optimizer_state_dict(trainer.model, optimizer, to=0)
    else:
        optimizer.consolidate_state_dict(to=0)
        model = trainer.model.state_dict()
        optim = optimizer.state_dict() if trainer.world.is_main else None
    return {"model": model, "optimizer": optim} if trainer.world.is_main else None


def _train(root: Path, stage: int, run: Run) -> None:
    name, offloaded, steps, source = run
    offload: dict[str, Any] = {}
    if offloaded:
        offload = {
            "zero_offload": "disk",
            "zero_offload_dir": str(root / "scratch"),
            "zero_offload_window_mb": 0.001,
        }
    args = _args(root / name, zero_stage=stage, max_steps=steps, save_steps=steps, **offload)
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    out = trainer.train(resume_from_checkpoint=str(root / source) if source else None)
    assert out.global_step == steps
    state = _consolidated(trainer, stage)
    if state is not None:
        torch.save(state, root / f"{name}.pt")
    trainer.close()


def _phase(rank: int, world: int, root: str, stages: list[int], runs: list[Run]) -> None:
    phalanx.init(backend="gloo")  # one group for all the Trainers of this worker
    for stage in stages:
        for run in runs:
            _train(Path(root) / f"stage{stage}", stage, run)


def _equal(root: Path, loaded: str, checkpoint: str) -> bool:
    """Whether run `loaded` held exactly what consolidate makes of `checkpoint`."""
    whole = consolidate(root / checkpoint, root / f"{loaded}-consolidated.pt")
    return _same(torch.load(root / f"{loaded}.pt", weights_only=True), whole)


FIRST: list[Run] = [("offloaded", True, 5, None), ("plain", False, 5, None)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_offload_on_and_off_at_the_same_world_loads_the_consolidated_state(
    tmp_path: Path, stage: int
) -> None:
    swapped: list[Run] = [
        ("to-plain", False, 5, "offloaded/checkpoint-5"),
        ("to-offloaded", True, 5, "plain/checkpoint-5"),
    ]
    run_workers(_phase, 2, str(tmp_path), [stage], FIRST + swapped, timeout=240)
    root = tmp_path / f"stage{stage}"
    # consolidate reads an offloaded run's checkpoint whole: the state its ranks held.
    whole = consolidate(root / "offloaded" / "checkpoint-5", root / "consolidated.pt")
    assert _same(whole, torch.load(root / "offloaded.pt", weights_only=True))
    assert _equal(root, "to-plain", "offloaded/checkpoint-5")
    assert _equal(root, "to-offloaded", "plain/checkpoint-5")
    assert list((root / "scratch").iterdir()) == []


@pytest.mark.slow  # a third rank on two cores
@pytest.mark.timeout(600)
def test_an_offloaded_checkpoint_reshards_from_two_ranks_to_three_and_back(tmp_path: Path) -> None:
    stages = [1, 3]
    run_workers(_phase, 2, str(tmp_path), stages, FIRST[:1], timeout=240)
    three: list[Run] = [
        ("three-load", True, 5, "offloaded/checkpoint-5"),
        ("three", True, 8, "offloaded/checkpoint-5"),
    ]
    run_workers(_phase, 3, str(tmp_path), stages, three, timeout=300)
    back: list[Run] = [("back-load", True, 8, "three/checkpoint-8")]
    run_workers(_phase, 2, str(tmp_path), stages, back, timeout=240)
    for stage in stages:
        root = tmp_path / f"stage{stage}"
        assert _equal(root, "three-load", "offloaded/checkpoint-5"), stage
        assert _equal(root, "back-load", "three/checkpoint-8"), stage
        # The world-3 run's own state when it saved is what its checkpoint consolidates to.
        assert _equal(root, "three", "three/checkpoint-8"), stage
        assert list((root / "scratch").iterdir()) == []
