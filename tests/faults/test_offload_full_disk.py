"""A full offload disk (issue 23, "Faults"): the checkpoints stay good, and a restart with a
good zero_offload_dir resumes bit for bit.

Each phase is a fresh set of 2 gloo ranks, as a restart is:

1. A run with its offload directory on a 4 MB tmpfs saves checkpoint-4; in
   step 5 another writer fills that disk to the last byte. The offloaded files
   were allocated whole (posix_fallocate) when the state was made, so the run
   goes on untouched (no SIGBUS, no error), saves checkpoint-8, and then
   crashes in step 10 (an exception on both ranks, standing in for any fault).
   Its scratch goes at its exit, and the other writer takes that space too.
2. The restart, with the offload directory still on the full disk, must make
   its offloaded state anew (the dead run's is never reused): it fails with
   the one-line "the disk is full" on every rank, writes nothing, leaves no
   scratch on the disk, and both checkpoints still verify against their
   manifests.
3. The restart with zero_offload_dir on a good disk resumes from checkpoint-8
   and ends with exactly the parameters of a run never interrupted.

And a disk full on one rank only (another node's disk: here a tmpfs mounted in
rank 1's own mount namespace, at the path rank 0 sees as a good directory), met
by a stage-3 restart while it makes the optimizer state to load the checkpoint
into: the one line on both ranks at once. Before, rank 1 raised alone and met
rank 0 in a different collective (rank 0 was reading the checkpoint): both hung
for the collective timeout and then reported only gloo's timeout.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import pytest

from phalanx.train.checkpoint.directory import list_checkpoints, verify_checkpoint
from tests.disks import fill, own_disk
from tests.faults.trainkit import make_trainer
from tests.harness import run_workers

pytestmark = pytest.mark.faults

MAX_STEPS = 12
FILL_AT, CRASH_AT = 5, 10


class _Crash(Exception):
    pass


def _local_params(trainer: Any) -> list[list[float]]:
    """This rank's parameters (stage 3: its shards), as plain lists."""
    return [
        getattr(p, "_local_tensor", p).detach().reshape(-1).tolist()
        for p in trainer.model.parameters()
    ]


def _settings(stage: int, offload_dir: Path) -> dict[str, Any]:
    return {
        "zero_stage": stage,
        "zero_offload": "disk",
        "zero_offload_dir": str(offload_dir),
        "zero_offload_window_mb": 0.001,
        "max_steps": MAX_STEPS,
        "save_steps": 4,
        "gradient_accumulation_steps": 2,
    }


def _fill_to_the_last_byte(disk: Path) -> int:
    """Fill `disk`, then top it up a byte at a time; the bytes left (0)."""
    fill(disk)
    with (disk / "filler").open("ab", buffering=0) as file:
        while os.statvfs(disk).f_bavail:
            try:
                file.write(bytes(os.statvfs(disk).f_bsize))
            except OSError:
                break
    return os.statvfs(disk).f_bavail


def _reference_then_crash(rank: int, world: int, root: str, disk: str, stage: int) -> Any:
    reference = make_trainer(Path(root) / "reference", **_settings(stage, Path(root) / "good"))
    reference.train()
    straight = _local_params(reference)
    reference.close()
    left: list[int] = []

    def fault(trainer: Any) -> None:
        step = trainer.state.global_step + 1
        if step == FILL_AT and rank == 0 and not left:
            left.append(_fill_to_the_last_byte(Path(disk)))
        if step == CRASH_AT:
            raise _Crash(f"the crash in step {step}")

    crashing = make_trainer(Path(root) / "run", fault, **_settings(stage, Path(disk)))
    try:
        crashing.train()
    except _Crash as crash:
        crashed = str(crash)
        crashing.close()  # as the interpreter's exit would (the harness leaves by os._exit)
    else:
        crashed = "no crash"
    return {"straight": straight, "crashed": crashed, "left": left}


def _restart(rank: int, world: int, root: str, offload_dir: str, stage: int) -> Any:
    try:
        trainer = make_trainer(Path(root) / "run", **_settings(stage, Path(offload_dir)))
        out = trainer.train(resume_from_checkpoint=True)
    except Exception:
        atexit._run_exitfuncs()  # what the interpreter's exit runs (the harness os._exits)
        raise
    params = _local_params(trainer)
    trainer.close()
    return {"resumed_from": out.resumed_from, "step": out.global_step, "params": params}


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_a_full_offload_disk_loses_nothing_and_a_good_dir_resumes_bit_identical(
    tmp_path: Path, small_disk: Path, stage: int
) -> None:
    root, disk = str(tmp_path), str(small_disk)
    first = run_workers(_reference_then_crash, 2, root, disk, stage, timeout=180)
    assert [o.value["crashed"] for o in first] == [f"the crash in step {CRASH_AT}"] * 2
    assert first[0].value["left"] == [0]  # the disk was full from step 5 on, and it trained on
    run = tmp_path / "run"
    assert sorted(step for step, _ in list_checkpoints(run)) == [4, 8]
    # The crashed run's scratch went at its exit, and gave its space back: the other
    # writer takes it again.
    assert [p.name for p in small_disk.iterdir()] == ["filler"]
    assert _fill_to_the_last_byte(small_disk) == 0

    full = run_workers(_restart, 2, root, disk, stage, allow_errors=True)
    for o in full:
        assert o.error_type == "OffloadError", (o.error_type, o.error, o.traceback)
        assert f"zero_offload_dir={small_disk}: the disk is full" in (o.error or "")
        assert "\n" not in (o.error or "").strip()
    assert sorted(step for step, _ in list_checkpoints(run)) == [4, 8]
    assert not list(run.glob("*.tmp"))
    for _, checkpoint in list_checkpoints(run):
        verify_checkpoint(checkpoint)  # raises on a torn or changed file
    assert [p.name for p in small_disk.iterdir()] == ["filler"]  # no scratch left behind

    good = run_workers(_restart, 2, root, str(tmp_path / "good"), stage)
    for o, before in zip(good, first, strict=True):
        assert o.value["resumed_from"] == str(run / "checkpoint-8")
        assert o.value["step"] == MAX_STEPS
        assert o.value["params"] == before.value["straight"]
    assert list((tmp_path / "good").iterdir()) == []


def _checkpoint_4(rank: int, world: int, root: str) -> None:
    settings = {**_settings(3, Path(root) / "good"), "max_steps": 4}
    make_trainer(Path(root) / "run", **settings).train()


def _restart_rank1_disk_small(rank: int, world: int, root: str) -> Any:
    offload = Path(root) / "offload"
    if rank == 1:  # room for its 4 shards (a page each) and 5 pages of its 6 of AdamW state
        own_disk(offload, "36k")
    return _restart(rank, world, root, str(offload), 3)


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_disk_full_on_one_rank_at_a_restart_is_one_line_on_every_rank(tmp_path: Path) -> None:
    run_workers(_checkpoint_4, 2, str(tmp_path))
    # Within the collective timeout (60 s): a hang fails the test.
    outcomes = run_workers(
        _restart_rank1_disk_small, 2, str(tmp_path), allow_errors=True, timeout=45
    )
    offload = tmp_path / "offload"
    for o, prefix in zip(outcomes, ["rank 1: ", ""], strict=True):
        assert o.error_type == "OffloadError", (o.error_type, o.error, o.traceback)
        assert (o.error or "").startswith(f"{prefix}zero_offload_dir={offload}: the disk is full")
    run = tmp_path / "run"
    assert [step for step, _ in list_checkpoints(run)] == [4]
    verify_checkpoint(run / "checkpoint-4")


def _setup_rank1_disk_tiny(rank: int, world: int, root: str, meta: bool) -> str:
    """Rank 1's offload directory on a one-page disk, rank 0's on a good one; a stage-3
    Trainer with disk offload (its shards and gradients are files from the start)."""
    import torch

    from tests.faults.trainkit import DropoutNet

    offload = Path(root) / "offload"
    if rank == 1:
        own_disk(offload, "4k")
    if meta:
        with torch.device("meta"):
            model = DropoutNet()
    else:
        model = DropoutNet()
    make_trainer(Path(root) / "run", model=model, **_settings(3, offload))
    return "made"


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
@pytest.mark.parametrize("meta", [False, True], ids=["cpu_built", "meta_built"])
def test_a_disk_full_on_one_rank_while_sharding_is_one_line_on_every_rank(
    tmp_path: Path, meta: bool
) -> None:
    """fully_shard makes each shard's and gradient's file; on a meta-built model the shards'
    files are made when it is materialised. Both agree before the ranks' collectives drift
    apart (before: the other rank failed with gloo's "connection closed by peer")."""
    outcomes = run_workers(
        _setup_rank1_disk_tiny, 2, str(tmp_path), meta, allow_errors=True, timeout=60
    )
    offload = tmp_path / "offload"
    for o, prefix in zip(outcomes, ["rank 1: ", ""], strict=True):
        assert o.error_type == "OffloadError", (o.error_type, o.error, o.traceback)
        assert (o.error or "").startswith(f"{prefix}zero_offload_dir={offload}: the disk is full")
