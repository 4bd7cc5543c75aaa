"""What a Trainer checkpoint holds, and how a run picks one up exactly where it stopped.

Exact resume needs four things to continue unchanged: the data order (the
sampler's epoch and position), every rank's random generators (dropout), the
optimizer, scheduler and scaler states, and the micro-batch position. Rank 0
gathers the RNG states of every rank and writes one file per rank; all ranks
then meet, so no rank runs ahead of a checkpoint that may still fail.

Resuming with a different world size, per-device batch size, accumulation,
seed or drop_last is refused: the saved position would point at other
samples, and a silently different run is worse than an error.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx.data.sampler import DistributedSampler
from phalanx.errors import CheckpointError, ConfigurationError, PhalanxError
from phalanx.runtime import World
from phalanx.train.args import TrainingArguments
from phalanx.train.checkpoint import (
    find_latest_valid,
    load_file,
    rotate_checkpoints,
    verify_checkpoint,
    write_checkpoint,
)
from phalanx.train.rng import capture_rng_state

STATE_FILE = "trainer_state.pt"
# Arguments that decide which samples each rank reads at a given position.
DATA_LAYOUT_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "dataloader_drop_last",
)


class CheckpointFallbackWarning(UserWarning):
    """resume_from_checkpoint=True skipped a newer checkpoint that failed verification."""


@dataclass
class TrainState:
    """Where the loop stands; saved only between optimizer steps."""

    global_step: int = 0
    epoch: int = 0
    batches_done: int = 0
    """Micro-batches of `epoch` already trained on, by every rank."""


@dataclass(frozen=True)
class Stateful:
    """The objects whose state a checkpoint carries."""

    model: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    scaler: torch.amp.GradScaler | None
    sampler: DistributedSampler


def _rng_name(rank: int) -> str:
    return f"rng/rank-{rank:05d}.pt"


def _contents(
    parts: Stateful, state: TrainState, args: TrainingArguments, rng_states: list[Any]
) -> dict[str, Any]:
    consumed = min(state.batches_done * args.per_device_train_batch_size, len(parts.sampler))
    trainer_state = {
        "global_step": state.global_step,
        "epoch": state.epoch,
        "batches_done": state.batches_done,
        "world_size": len(rng_states),
        "sampler": parts.sampler.state_dict(consumed=consumed),
        "args": args.to_dict(),
    }
    contents: dict[str, Any] = {
        "model.pt": parts.model.state_dict(),
        "optimizer.pt": parts.optimizer.state_dict(),
        "scheduler.pt": parts.scheduler.state_dict(),
        STATE_FILE: trainer_state,
        "args.json": json.dumps(args.to_dict(), indent=1).encode(),
    }
    if parts.scaler is not None:
        contents["scaler.pt"] = parts.scaler.state_dict()
    for rank, rng in enumerate(rng_states):
        contents[_rng_name(rank)] = rng
    return contents


def save(parts: Stateful, state: TrainState, args: TrainingArguments, world: World) -> Path:
    """Every rank calls this; rank 0 writes, then all meet (and fail together)."""
    rng_states = world.all_gather_object(capture_rng_state())
    output_dir = Path(args.output_dir)
    path = output_dir / f"checkpoint-{state.global_step}"
    error: PhalanxError | None = None
    if world.is_main:
        try:
            write_checkpoint(
                output_dir, state.global_step, _contents(parts, state, args, rng_states)
            )
            rotate_checkpoints(output_dir, args.save_total_limit)
        except Exception as exc:  # rank 0 alone failing must not leave the others waiting
            error = CheckpointError(
                f"could not write {path} ({type(exc).__name__}: {exc}) — check free space and "
                f"permissions of output_dir={args.output_dir}, and that every state is "
                "made of tensors and plain values"
            )
    world.barrier_or_raise(error)
    return path


def _choose_locally(resume: bool | str | Path, output_dir: Path) -> Path | None:
    if resume is not True:
        given = Path(resume)  # type: ignore[arg-type]
        verify_checkpoint(given)
        return given
    path, skipped = find_latest_valid(output_dir)
    if path is None and skipped:
        raise CheckpointError(
            f"resume_from_checkpoint=True found checkpoints in {output_dir} but none is "
            f"valid ({'; '.join(skipped)}) — delete them to start afresh, or pass a path"
        )
    for reason in skipped:
        warnings.warn(
            f"skipping a checkpoint that failed verification: {reason}; resuming from "
            f"{path} instead",
            CheckpointFallbackWarning,
            stacklevel=4,
        )
    return path


def choose(resume: bool | str | Path, output_dir: Path, world: World) -> Path | None:
    """The checkpoint to resume from, chosen by rank 0 and the same on every rank.

    True: the newest valid one in output_dir, falling back past corrupt ones
    with a warning; None when output_dir has no checkpoint yet (a first run).
    A path: that checkpoint, which must be valid.
    """
    chosen: str | None = None
    error: PhalanxError | None = None
    if world.is_main:
        try:
            found = _choose_locally(resume, output_dir)
            chosen = None if found is None else str(found)
        except PhalanxError as exc:
            error = exc
        except OSError as exc:
            error = CheckpointError(f"cannot read checkpoints in {output_dir} ({exc}) — check it")
    world.barrier_or_raise(error)
    chosen = world.broadcast_object(chosen)
    return None if chosen is None else Path(chosen)


def _check_compatible(saved: dict[str, Any], args: TrainingArguments, world: World) -> None:
    if saved["world_size"] != world.world_size:
        raise ConfigurationError(
            f"the checkpoint was written by a job of {saved['world_size']} rank(s) but this "
            f"run has {world.world_size} — resume with world size {saved['world_size']} "
            "(e.g. --nproc-per-node); another world size would read other samples at the "
            "saved position, so it is refused rather than resumed wrong"
        )
    for name in DATA_LAYOUT_FIELDS:
        before, now = saved["args"].get(name), getattr(args, name)
        if before != now:
            raise ConfigurationError(
                f"the checkpoint was written with {name}={before!r} but this run has "
                f"{name}={now!r} — resume with the same value; it decides which samples "
                "come next"
            )


def restore(
    path: Path, parts: Stateful, args: TrainingArguments, world: World
) -> tuple[TrainState, dict[str, Any]]:
    """Load everything but the RNG into `parts`; return the state and this rank's RNG.

    The caller restores the RNG last, right before the loop continues, so
    nothing in between can draw from it.
    """
    error: PhalanxError | None = None
    result: tuple[TrainState, dict[str, Any]] | None = None
    try:
        result = _load(path, parts, args, world)
    except PhalanxError as exc:
        error = exc
    except Exception as exc:  # load_state_dict mismatches; raised on every rank below
        error = CheckpointError(
            f"{path} does not fit this model or optimizer ({type(exc).__name__}: {exc}) — "
            "resume with the model and optimizer that wrote it"
        )
    world.barrier_or_raise(error)
    assert result is not None
    return result


def _load(
    path: Path, parts: Stateful, args: TrainingArguments, world: World
) -> tuple[TrainState, dict[str, Any]]:
    saved = load_file(path, STATE_FILE)
    _check_compatible(saved, args, world)
    parts.model.load_state_dict(load_file(path, "model.pt"))
    parts.optimizer.load_state_dict(load_file(path, "optimizer.pt"))
    parts.scheduler.load_state_dict(load_file(path, "scheduler.pt"))
    if parts.scaler is not None:
        parts.scaler.load_state_dict(load_file(path, "scaler.pt"))
    parts.sampler.load_state_dict(saved["sampler"])
    state = TrainState(saved["global_step"], saved["epoch"], saved["batches_done"])
    return state, load_file(path, _rng_name(world.rank))
