"""Background saves (issue 39, item 1): the loop trains on while a checkpoint is written, and
the checkpoint is still the step's.

The write of checkpoint-2 is held (asynckit.Gate, an event) until the loop is
inside step 4: a save the loop waited for could never get there, so the run
would hang (the harness's deadline fails it). Training moved the state on twice
before a byte of checkpoint-2 was written, and a run resumed from it must still
end bit for bit where the uninterrupted run ends: the state was copied at the
step boundary. The write of checkpoint-4 is held until the save of checkpoint-6
has to wait for it: one save in flight, and the wait said. `save_async=False`
writes on the training thread, as before.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import phalanx.train.checkpoint.writes as writes
from phalanx.train.checkpoint.directory import list_checkpoints, verify_checkpoint
from tests.faults.asynckit import Gate, hold_writes, local_params, record_holds, said
from tests.faults.trainkit import in_step, make_trainer
from tests.harness import run_workers

pytestmark = pytest.mark.faults


def _settings(stage: int | str, root: Path) -> dict[str, Any]:
    if stage in ("3d", "3p"):  # stage 3 with disk offload: its files are written from, uncopied
        return {"zero_stage": 3, "zero_offload": "disk", "zero_offload_dir": str(root / "off")}
    return {"zero_stage": stage}


def _model(stage: int | str, root: Path, run: str) -> Any:
    """ "3p": the model sharded before the Trainer gets it, with a DiskOffloadPolicy of its own
    (FSDP2's way to build a model that never fits a rank whole): its shards live in that
    policy's directory, the optimizer's state in zero_offload_dir."""
    if stage != "3p":
        return None
    import torch
    import torch.distributed as dist

    import phalanx
    from tests.faults.trainkit import DropoutNet

    if not dist.is_initialized():
        phalanx.init(backend="gloo")
    torch.manual_seed(0)
    model = DropoutNet()
    policy = phalanx.DiskOffloadPolicy(path=str(root / f"own-{run}"))
    for layer in (model.net[0], model.net[3]):
        phalanx.fully_shard(layer, offload_policy=policy)
    return phalanx.fully_shard(model, offload_policy=policy)


def _held_run(rank: int, world: int, root: str, stage: int | str) -> dict[str, Any]:
    base = Path(root)
    whole = make_trainer(
        base / "whole", model=_model(stage, base, "whole"), save_steps=0, **_settings(stage, base)
    )
    whole.train()
    straight = local_params(whole)

    second, fourth = Gate(2), Gate(4)
    hold_writes(second, fourth, release_on_collect=True)
    holds = record_holds()

    def release_in_step_4(trainer: Any) -> None:
        if in_step(trainer, 4):
            second.release.set()

    held = make_trainer(
        base / "held",
        release_in_step_4,
        model=_model(stage, base, "held"),
        save_steps=2,
        **_settings(stage, base),
    )
    lines = said(held)
    held.train()

    resumed = make_trainer(
        base / "resumed",
        model=_model(stage, base, "resumed"),
        save_steps=0,
        **_settings(stage, base),
    )
    out = resumed.train(resume_from_checkpoint=str(base / "held" / "checkpoint-2"))
    return {
        "straight": straight,
        "resumed": local_params(resumed),
        "resumed_from": out.resumed_from,
        "lines": lines,
        "writer": second.thread,
        "held_bytes": [hold.held_bytes for hold in holds],
        "aside_bytes": [hold.aside_bytes for hold in holds],
        "param_bytes": sum(getattr(p, "_local_tensor", p).nbytes for p in held.model.parameters()),
    }


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 3, "3d", "3p"])
@pytest.mark.timeout(240)
def test_the_loop_trains_on_while_a_checkpoint_is_written_and_it_is_the_steps(
    tmp_path: Path, stage: int | str
) -> None:
    runs = run_workers(_held_run, 2, str(tmp_path), stage, init_pg=False, timeout=220)
    for run in runs:
        assert run.value["writer"] == "phalanx-save-2"
        assert run.value["resumed_from"] == str(tmp_path / "held" / "checkpoint-2")
        assert run.value["resumed"] == run.value["straight"], "checkpoint-2 is not step 2's"
        held, aside = run.value["held_bytes"], run.value["aside_bytes"]
        if stage in ("3d", "3p"):
            # Every save wrote its offloaded shards and state from their files, uncopied at
            # the step; checkpoint-2's, held until step 4, had all of it copied aside first.
            # "3p": the shards too, though they live in the model's own policy's directory
            # (they were copied whole at each save: the 375M MLP under a cap was killed).
            # Held: the shards and Adam's two moments, 3x the shards' bytes (less a one-element
            # shard's moments, which stay in memory); the moments alone are at most 2x.
            shards = run.value["param_bytes"]
            assert len(held) == 4 and all(2 * shards < b <= 3 * shards for b in held), (
                held,
                run.value["param_bytes"],
            )
            assert aside[0] == held[0], (held, aside)
        else:
            assert held == [], held
    held = tmp_path / "held"
    assert [step for step, _ in list_checkpoints(held)] == [8, 6, 4, 2]
    for _, path in list_checkpoints(held):
        verify_checkpoint(path)
    assert not [p.name for p in held.iterdir() if ".tmp" in p.name]
    lines = runs[0].value["lines"]
    saved = [line.split(" (")[0] for line in lines if line.startswith("saved ")]
    assert saved == [f"saved checkpoint-{s}" for s in (2, 4, 6, 8)], lines
    # checkpoint-4's write was held until the save of checkpoint-6 waited for it (others
    # may wait too, on a slow disk).
    waited = [line for line in lines if line.startswith("checkpoint-6 waited ")]
    assert len(waited) == 1, lines
    assert waited[0].endswith("for checkpoint-4 to finish writing (one save in flight at a time)")
    assert lines.index(waited[0]) == lines.index(saved_line(lines, 4)) + 1, lines


def saved_line(lines: list[str], step: int) -> str:
    return next(line for line in lines if line.startswith(f"saved checkpoint-{step} ("))


def _threads_of_a_sync_run(rank: int, world: int, root: str) -> dict[str, Any]:
    threads: set[str] = set()
    original = writes.write_file

    def write_file(*args: Any) -> Any:
        threads.add(threading.current_thread().name)
        return original(*args)

    writes.write_file = write_file  # type: ignore[assignment]
    trainer = make_trainer(root, save_steps=4, save_async=False)
    lines = said(trainer)
    trainer.train()
    return {"threads": sorted(threads), "lines": lines}


@pytest.mark.timeout(120)
def test_save_async_false_writes_on_the_training_thread(tmp_path: Path) -> None:
    runs = run_workers(_threads_of_a_sync_run, 2, str(tmp_path), init_pg=False, timeout=100)
    assert runs[0].value["threads"] == ["MainThread"]
    saved = [line for line in runs[0].value["lines"] if line.startswith("saved ")]
    assert [line.split(" (")[0] for line in saved] == ["saved checkpoint-4", "saved checkpoint-8"]
    assert not any("the loop waited" in line for line in saved), saved
