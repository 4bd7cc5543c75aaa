"""A NaN on one rank stops the run, or is skipped on every rank, and never reaches a
checkpoint (issue 12, item 3).

Before: rank 1's NaN loss reached every replica at the all-reduce, the job
exited 0, and with save_total_limit=2 both kept checkpoints held NaN
parameters (torch DDP spreads the NaN the same way). Each scenario poisons
the loss of a chosen step on a chosen rank, on 2 real gloo ranks, one spawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.train import NonFiniteError, Trainer
from tests.faults.trainkit import in_step, make_trainer, parameters
from tests.harness import run_scenarios, run_workers

pytestmark = pytest.mark.faults


def _nan_at(steps: set[int], rank: int | None) -> Any:
    return lambda trainer: math.nan if any(in_step(trainer, s, rank) for s in steps) else None


def _before_steps(steps: set[int], seen: dict[int, Any]) -> Any:
    """A fault that records the parameters as each of `steps` starts (after the previous
    step's update)."""

    def fault(trainer: Trainer) -> None:
        step = trainer.state.global_step + 1
        if step in steps and step not in seen:
            seen[step] = parameters(trainer)

    return fault


def _error(run: Any) -> Any:
    try:
        run()
    except NonFiniteError as exc:
        return str(exc)
    return "no error"


def _stop(out: Path) -> dict[str, Any]:
    seen: dict[int, Any] = {}
    record = _before_steps({3}, seen)
    poison = _nan_at({3}, rank=1)
    trainer = make_trainer(out, lambda t: record(t) or poison(t))
    error = _error(trainer.train)
    return {
        "error": error,
        "unchanged": parameters(trainer) == seen[3],
        "scheduler_steps": trainer.scheduler.last_epoch,
    }


def _skip(out: Path) -> dict[str, Any]:
    seen: dict[int, Any] = {}
    record = _before_steps({3, 4, 5}, seen)
    poison = _nan_at({3, 6, 7, 8}, rank=0)
    trainer = make_trainer(
        out,
        lambda t: record(t) or poison(t),
        on_nonfinite_grad="skip",
        max_consecutive_skips=3,
        max_steps=10,
        logging_steps=1,
        report_to=["jsonl"],
    )
    error = _error(trainer.train)
    adam = trainer.optimizer.state_dict()["state"][0]
    params = parameters(trainer)
    return {
        "error": error,
        "finite": all(math.isfinite(v) for p in params for v in p),
        "skipped": (trainer.state.skipped_steps, trainer.state.global_step),
        "adam_steps": float(adam["step"]),
        "scheduler_steps": trainer.scheduler.last_epoch,
        "step3_untouched": seen[3] == seen[4],
        "step4_moved": seen[4] != seen[5],
    }


def _nan_checkpoint(out: Path) -> dict[str, Any]:
    # Checks off: the NaN of step 5 reaches the parameters, and the save at step 6 must refuse.
    trainer = make_trainer(
        out,
        _nan_at({5}, rank=1),
        on_nonfinite_grad="off",
        save_steps=2,
        save_total_limit=2,
        max_steps=10,
    )
    return {"error": _error(trainer.train)}


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return run_scenarios(
        {
            "stop": lambda: _stop(base / "stop"),
            "skip": lambda: _skip(base / "skip"),
            "checkpoint": lambda: _nan_checkpoint(base / "checkpoint"),
        },
        rank,
    )


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("nonfinite")
    runs = run_workers(_scenarios, 2, str(root), init_pg=False, timeout=180)
    return root, [run.value for run in runs]


@pytest.mark.timeout(240)
def test_a_nan_on_one_rank_stops_every_rank_before_anything_steps(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, values = outcomes
    for value in values:
        stop = value["stop"]
        assert "step 3: the gradient is not finite" in stop["error"], stop
        assert "the loss was not finite on rank(s) [1]" in stop["error"]
        assert "nothing was stepped" in stop["error"]
        assert stop["unchanged"], "step 3 changed the parameters"
        assert stop["scheduler_steps"] == 2


@pytest.mark.timeout(240)
def test_skipping_leaves_optimizer_and_schedule_untouched_and_stops_after_k_in_a_row(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, values = outcomes
    for value in values:
        skip = value["skip"]
        assert "step 8: the gradient is not finite" in skip["error"], skip
        assert "3 skipped steps in a row (max_consecutive_skips=3)" in skip["error"]
        assert skip["finite"]
        # Steps 3, 6, 7, 8 skipped: 4 updates of AdamW and of the schedule; step 8 raised
        # before it counted.
        assert skip["skipped"] == (4, 7)
        assert skip["step3_untouched"] and skip["step4_moved"]
        assert (skip["adam_steps"], skip["scheduler_steps"]) == (4.0, 4)
    logged = [json.loads(line) for line in (root / "skip" / "metrics.jsonl").open()]
    counts = {row["step"]: row["skipped_steps"] for row in logged}
    assert [counts[s] for s in (2, 3, 5, 6, 7)] == [0.0, 1.0, 1.0, 2.0, 3.0], counts
    assert "loss" not in logged[2]  # step 3 was skipped: no NaN in the logs


@pytest.mark.timeout(240)
def test_no_checkpoint_with_nan_parameters_is_written_and_rotation_keeps_the_finite_ones(
    outcomes: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, values = outcomes
    for value in values:
        error = value["checkpoint"]["error"]
        assert "is not finite (NaN or inf) at step 6, so checkpoint-6 is not written" in error
    out = root / "checkpoint"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    for kept in ("checkpoint-2", "checkpoint-4"):
        state = torch.load(out / kept / "model.pt", weights_only=True)
        assert all(bool(torch.isfinite(t).all()) for t in state.values()), kept
