"""Faults during a background save (issue 39, "What it must show"): a preemption signal and a
full disk while a checkpoint is being written.

SIGTERM while checkpoint-2 is held in its writer (asynckit.Gate: released only
when the training thread waits for it): the ranks agree to stop after step 3,
checkpoint-2 completes, then the stop's own checkpoint-3 is written, then the
exit with 128 + 15; resuming ends bit for bit where the uninterrupted run ends.
SIGTERM in the step of the save itself: the save in flight is the stop's.

A full disk during the background write of checkpoint-4 (the writer fills it,
then writes; at stage 3 every rank's shards meet it too): one CheckpointError
line on every rank, at the same step;
checkpoint-2 intact and nothing else left; the model in memory is the one an
undisturbed run has at that step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

import phalanx.train.checkpoint.writes as writes
from phalanx.errors import CheckpointError
from phalanx.train import TrainingStopped
from phalanx.train.checkpoint.directory import list_checkpoints, verify_checkpoint
from tests.disks import fill
from tests.faults.asynckit import Gate, hold_writes, local_params, said
from tests.faults.trainkit import in_step, make_trainer
from tests.harness import run_scenarios, run_workers

pytestmark = pytest.mark.faults


def _sigterm_in(step: int, rank: int) -> Any:
    sent: list[bool] = []

    def fault(trainer: Any) -> None:
        if in_step(trainer, step, rank) and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    return fault


def _stop_while_writing(out: Path, signal_step: int) -> dict[str, Any]:
    trainer = make_trainer(out, _sigterm_in(signal_step, rank=1), save_steps=2)
    lines = said(trainer)
    try:
        trainer.train(resume_from_checkpoint=True)
    except TrainingStopped as stop:
        result: dict[str, Any] = {"code": stop.code, "message": str(stop)}
    else:
        result = {"code": None}
    result["lines"] = lines
    result["checkpoints"] = sorted(step for step, _ in list_checkpoints(out))
    resumed = make_trainer(out, save_steps=2)
    result["resumed_from"] = resumed.train(resume_from_checkpoint=True).resumed_from
    result["params"] = local_params(resumed)
    return result


def _preempted(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    hold_writes(Gate(2), release_on_collect=True)
    return run_scenarios(
        {
            "whole": lambda: _whole(base / "whole"),
            "after": lambda: _stop_while_writing(base / "after", signal_step=3),
            "same": lambda: _stop_while_writing(base / "same", signal_step=2),
        },
        rank,
    )


def _whole(out: Path) -> list[list[float]]:
    trainer = make_trainer(out)
    trainer.train()
    return local_params(trainer)


@pytest.mark.timeout(200)
def test_a_save_in_flight_at_sigterm_completes_before_the_exit(tmp_path: Path) -> None:
    runs = run_workers(_preempted, 2, str(tmp_path), init_pg=False, timeout=180)
    for run in runs:
        whole = run.value["whole"]
        for name, step in (("after", 3), ("same", 2)):
            got = run.value[name]
            assert "error" not in got, got
            assert got["code"] == 128 + signal.SIGTERM, got
            assert got["message"] == (
                f"stopped by SIGTERM (received by rank 1) at step {step}; saved checkpoint-{step}"
            )
            assert got["checkpoints"] == sorted({2, step}), got
            assert got["resumed_from"] == str(tmp_path / name / f"checkpoint-{step}")
            assert got["params"] == whole, f"{name}: the resumed run ended elsewhere"
    after = runs[0].value["after"]["lines"]
    saved = [line.split(" (")[0] for line in after if line.startswith("saved ")]
    assert saved == ["saved checkpoint-2", "saved checkpoint-3"], after
    same = runs[0].value["same"]["lines"]
    assert [line.split(" (")[0] for line in same if line.startswith("saved ")] == [
        "saved checkpoint-2"
    ], same


def _full_disk_in_the_writer(
    rank: int, world: int, root: str, disk: str, stage: int
) -> dict[str, Any]:
    snapshots: dict[int, list[list[float]]] = {}

    def snapshot(trainer: Any) -> None:  # the parameters after each step, as the next begins
        snapshots.setdefault(trainer.state.global_step, local_params(trainer))

    reference = make_trainer(Path(root) / "reference", snapshot, zero_stage=stage)
    reference.train()
    snapshots[reference.state.global_step] = local_params(reference)

    original = writes.write

    def filling_write(world_: Any, lineage: Any, staged: writes.Staged) -> Any:
        if staged.step == 4 and world_.rank == 0:
            fill(Path(disk))  # the disk fills while this rank's writer is about to write
        return original(world_, lineage, staged)

    writes.write = filling_write  # type: ignore[assignment]
    trainer = make_trainer(Path(disk) / "run", save_steps=2, zero_stage=stage)
    try:
        trainer.train()
    except CheckpointError as exc:
        error = str(exc)
    else:
        error = "no error"
    step = trainer.state.global_step
    return {"error": error, "step": step, "intact": local_params(trainer) == snapshots[step]}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_full_disk_during_a_background_write_is_one_line_and_loses_nothing(
    tmp_path: Path, small_disk: Path, stage: int
) -> None:
    disk = str(small_disk)
    runs = run_workers(
        _full_disk_in_the_writer, 2, str(tmp_path), disk, stage, init_pg=False, timeout=180
    )
    for run in runs:
        error = run.value["error"]
        assert "\n" not in error, error
        assert error.removeprefix("rank 0: ").startswith("could not write checkpoint-4: "), error
        assert "no space left on device" in error and "checkpoint-2 is intact" in error, error
        assert run.value["intact"], "the model in memory is not the step's"
    assert runs[0].value["step"] == runs[1].value["step"]  # raised at the same step
    out = small_disk / "run"
    assert [p.name for p in out.iterdir()] == ["checkpoint-2"]
    verify_checkpoint(out / "checkpoint-2")
