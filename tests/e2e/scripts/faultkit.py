"""Faults that trainer_resume.py injects for real: a signal in a chosen step, a SIGKILL at a
chosen point of a checkpoint save. Only on the launcher's first attempt, so that a restart
(--max-restarts) runs clean."""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import phalanx.train.checkpointer as checkpointer
from phalanx.train import Trainer

# Long enough that a signal the launcher passes on arrives while this step still runs.
LAUNCHER_LATENCY_S = 2.0


def first_attempt() -> bool:
    return os.environ.get("PHALANX_RESTART_COUNT", "0") == "0"


def signal_in_step(trainer: Trainer, opts: argparse.Namespace) -> None:
    """Send opts.signal (count times) during step signal_after_step + 1, once per run."""
    step = opts.signal_after_step
    if not (step and trainer.state.global_step == step and trainer.world.rank == opts.signal_rank):
        return
    if not first_attempt() or getattr(trainer, "_signalled", False):
        return
    trainer._signalled = True  # type: ignore[attr-defined]  # one micro-batch only
    target = os.getppid() if opts.signal_launcher else os.getpid()
    for _ in range(opts.signal_count):
        os.kill(target, signal.Signals[opts.signal])
        time.sleep(0.05)  # two Ctrl-C are two key presses, not one
    if opts.signal_launcher:
        time.sleep(LAUNCHER_LATENCY_S)


def kill_in_save(trainer: Trainer, where: str) -> None:
    """SIGKILL rank RANK inside the save of checkpoint-STEP, at POINT:

    "enter" (the save begins), "file<k>" (rank 0 has written k files of the
    checkpoint), "seal" (every file written, before the rename into place),
    "sealed" (renamed into place, before the rotation).
    """
    step, rank, point = where.split(":")
    if int(rank) != trainer.world.rank or not first_attempt():
        return
    armed = lambda: trainer.state.global_step == int(step)  # noqa: E731
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    save, write_file, seal = trainer._checkpointer.save, checkpointer.write_file, checkpointer.seal
    written = [0]

    def save_then(*args: Any, **kwargs: Any) -> Any:
        written[0] = 0
        if armed() and point == "enter":
            die()
        return save(*args, **kwargs)

    def write_file_then(*args: Any) -> Any:
        if armed() and point == f"file{written[0]}":
            die()
        written[0] += 1
        return write_file(*args)

    def seal_then(*args: Any) -> Any:
        if armed() and point == "seal":
            die()
        sealed = seal(*args)
        if armed() and point == "sealed":
            die()
        return sealed

    trainer._checkpointer.save = save_then  # type: ignore[method-assign]
    checkpointer.write_file = write_file_then  # type: ignore[assignment]
    checkpointer.seal = seal_then  # type: ignore[assignment]
