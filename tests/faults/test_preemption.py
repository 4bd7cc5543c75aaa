"""Preemption saves the work: SIGTERM or Ctrl-C checkpoints at the step in flight
(issue 12, item 4).

Before: SIGTERM (SLURM's and Kubernetes' preemption signal) or Ctrl-C lost every
step since the last periodic save. Now every rank finishes the step in
flight, the ranks agree to stop, a checkpoint is written at that step, and
`train()` raises `TrainingStopped` (exit status 128 + the signal); resuming
from it ends bit for bit where an uninterrupted run ends. A second Ctrl-C
stops at once; `save_on_signal=False` leaves both signals alone.

The signals are real: a rank sends one to itself from inside its loss, in
the middle of a step. The launcher's part (SIGTERM to `phalanx launch`) is in
test_preemption_launch.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from phalanx.train import Trainer, TrainingStopped
from tests.faults.trainkit import in_step, make_trainer, parameters
from tests.harness import WorkersFailed, run_scenarios, run_workers

pytestmark = pytest.mark.faults


def _signal_in(step: int, rank: int, signum: int, times: int = 1) -> Any:
    """A fault that sends `signum` to this rank `times` times during `step` (once)."""
    sent: list[bool] = []

    def fault(trainer: Trainer) -> None:
        if in_step(trainer, step, rank) and not sent:
            sent.append(True)
            for _ in range(times):
                os.kill(os.getpid(), signum)

    return fault


def _stopped(trainer: Trainer) -> dict[str, Any]:
    try:
        trainer.train(resume_from_checkpoint=True)
    except TrainingStopped as stop:
        return {"code": stop.code, "message": str(stop), "step": trainer.state.global_step}
    return {"code": None}


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def _stop_and_resume(out: Path, signum: int, rank: int) -> dict[str, Any]:
    stop = _stopped(make_trainer(out, _signal_in(3, rank, signum)))
    stop["checkpoints"] = _checkpoints(out)
    resumed = make_trainer(out)
    stop["resumed_from"] = resumed.train(resume_from_checkpoint=True).resumed_from
    stop["params"] = parameters(resumed)
    return stop


def _whole(out: Path) -> list[list[float]]:
    trainer = make_trainer(out)
    trainer.train()
    return parameters(trainer)


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return run_scenarios(
        {
            "whole": lambda: _whole(base / "whole"),
            "sigterm": lambda: _stop_and_resume(base / "sigterm", signal.SIGTERM, rank=1),
            "sigint": lambda: _stop_and_resume(base / "sigint", signal.SIGINT, rank=0),
        },
        rank,
    )


@pytest.mark.timeout(200)
def test_a_signal_on_one_rank_checkpoints_the_step_and_resume_is_bit_identical(
    tmp_path: Path,
) -> None:
    runs = run_workers(_two_ranks, 2, str(tmp_path), init_pg=False, timeout=180)
    for run in runs:
        whole = run.value["whole"]
        for name, signum in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
            stop = run.value[name]
            assert stop["code"] == 128 + signum, stop
            receiver = 1 if name == "sigterm" else 0
            assert stop["message"] == (
                f"stopped by {name.upper()} (received by rank {receiver}) at step 3; "
                "saved checkpoint-3"
            )
            assert stop["checkpoints"] == ["checkpoint-3"]
            assert stop["resumed_from"] == str(tmp_path / name / "checkpoint-3")
            assert stop["params"] == whole, f"{name}: the resumed run ended elsewhere"


def _second_ctrl_c(rank: int, world: int, out: str) -> dict[str, Any]:
    trainer = make_trainer(out, _signal_in(3, 0, signal.SIGINT, times=2))
    try:
        trainer.train()
    except KeyboardInterrupt:
        return {"step": trainer.state.global_step, "saved": _checkpoints(Path(out))}
    return {"step": None}


def _signals_left_alone(rank: int, world: int, out: str, signum: int) -> dict[str, Any]:
    trainer = make_trainer(out, _signal_in(3, 0, signum), save_on_signal=False)
    try:
        trainer.train()
    except KeyboardInterrupt:
        return {"step": trainer.state.global_step, "saved": _checkpoints(Path(out))}
    return {"step": None}


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path: Path) -> None:
    [run] = run_workers(_second_ctrl_c, 1, str(tmp_path), init_pg=False, timeout=50)
    assert run.value["step"] == 2  # interrupted inside step 3
    assert run.value["saved"] == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_save_on_signal_false_leaves_sigint_and_sigterm_their_default(tmp_path: Path) -> None:
    [run] = run_workers(
        _signals_left_alone, 1, str(tmp_path / "int"), signal.SIGINT, init_pg=False, timeout=50
    )
    assert (run.value["step"], run.value["saved"]) == (2, [])
    with pytest.raises(WorkersFailed, match="exit=-15"):  # killed by SIGTERM, as by default
        run_workers(_signals_left_alone, 1, str(tmp_path / "term"), signal.SIGTERM, init_pg=False)
    assert not list((tmp_path / "term").glob("checkpoint-*"))
