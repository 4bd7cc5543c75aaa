"""Faults that trainer_resume.py injects for real: a signal in a chosen step, a SIGKILL at a
chosen point of a checkpoint save or of an offloaded optimizer step. Only on the launcher's
first attempt, so that a restart (--max-restarts) runs clean."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import phalanx.train.checkpoint.lineage as lineage
import phalanx.train.checkpoint.writes as writes
from phalanx.offload import Streamer, streamer_of
from phalanx.train import Trainer

# The bound on waiting for the signal the launcher passes on (an event, not a guess).
FORWARDED_WITHIN_S = 60.0


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
    if opts.signal_launcher:  # this step goes on until the launcher has passed it on
        deadline = time.monotonic() + FORWARDED_WITHIN_S
        while not trainer.setup.stop_requests.received and time.monotonic() < deadline:
            time.sleep(0.01)


def kill_in_save(trainer: Trainer, where: str) -> None:
    """SIGKILL rank RANK inside the save of checkpoint-STEP, at POINT:

    "enter" (the save begins), "file<k>" (rank 0 has written k files of the
    checkpoint), "seal" (every file written, before the rename into place),
    "sealed" (renamed into place, before the rotation).
    """
    step, rank, point = where.split(":")
    if int(rank) != trainer.world.rank or not first_attempt():
        return
    # The save's own step, not the loop's: a background save is written while the loop
    # trains on (its files live in checkpoint-STEP.<random>.tmp, its seal names the step).
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    checkpoints = trainer.setup.checkpointer
    save, background = checkpoints.save, checkpoints.start_background
    write_file, seal = writes.write_file, lineage.seal
    written = [0]

    def entered(save_step: int) -> None:
        written[0] = 0
        if save_step == int(step) and point == "enter":
            die()

    def save_then(states: Any, save_step: int, *args: Any) -> Any:
        entered(save_step)
        return save(states, save_step, *args)

    def background_then(states: Any, save_step: int, *args: Any) -> Any:
        entered(save_step)
        return background(states, save_step, *args)

    def write_file_then(directory: Path, *args: Any) -> Any:
        if directory.name.startswith(f"checkpoint-{step}."):
            if point == f"file{written[0]}":
                die()
            written[0] += 1
        return write_file(directory, *args)

    def seal_then(tmp: Path, save_step: int, *args: Any) -> Any:
        if save_step == int(step) and point == "seal":
            die()
        sealed = seal(tmp, save_step, *args)
        if save_step == int(step) and point == "sealed":
            die()
        return sealed

    checkpoints.save = save_then  # type: ignore[method-assign,assignment]
    checkpoints.start_background = background_then  # type: ignore[method-assign,assignment]
    writes.write_file = write_file_then  # type: ignore[assignment]
    lineage.seal = seal_then  # type: ignore[assignment]


def kill_in_background_write(trainer: Trainer, where: str, marker: Path) -> None:
    """SIGKILL this process at event N of the background write of checkpoint-STEP
    ("STEP:N"): the writer thread traces itself (sys.settrace: every call, line and return
    of Python it runs, DCP's and the seal's included), and at its N-th event it writes
    `marker` (which event, in which function) and kills the process, wherever the training
    thread is. N = -1 counts the write's events into `marker` instead, the event at which
    rank 0 begins to seal it (hash, manifest, rename, rotate) and the one at which the
    rename is done: a reference run says how many there are, so a trial can pick one.
    """
    step, nth = (int(part) for part in where.split(":"))
    original = writes.write

    def traced_write(world: Any, lineage: Any, staged: writes.Staged) -> writes.Saved:
        on_writer = threading.current_thread() is not threading.main_thread()
        if staged.step != step or not on_writer or not first_attempt():
            return original(world, lineage, staged)
        count, seal_at, renamed_at = [0], [0], [0]

        def trace(frame: Any, event: str, arg: Any) -> Any:
            count[0] += 1
            name = frame.f_code.co_name
            if event == "call" and name == "seal" and not seal_at[0]:
                seal_at[0] = count[0]
            if event == "return" and name == "_replace_dir" and not renamed_at[0]:
                renamed_at[0] = count[0]
            if count[0] == nth:
                code = frame.f_code
                place = f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"
                marker.write_text(json.dumps({"event": nth, "where": place}))
                os.kill(os.getpid(), signal.SIGKILL)
            return trace

        sys.settrace(trace)
        try:
            return original(world, lineage, staged)
        finally:
            sys.settrace(None)
            if nth < 0:
                counted = {"events": count[0], "seal_at": seal_at[0], "renamed_at": renamed_at[0]}
                marker.write_text(json.dumps(counted))

    writes.write = traced_write


def _streamer(trainer: Trainer) -> Streamer:
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeRO 1-2: the local one
    streamer = streamer_of(inner)
    assert streamer is not None, "kill_in_offload_step needs zero_offload='disk'"
    return streamer


def kill_in_offload_step(trainer: Trainer, where: str, marker: Path) -> None:
    """SIGKILL rank RANK inside the offloaded optimizer step of step STEP, at window WINDOW
    (modulo this rank's windows), at POINT:

    "stepped" (the training thread: the window's update made in the mapped pages,
    not yet handed to the I/O thread), "writing" (the I/O thread: part of that
    window's tensors written back and dropped, the rest not; where the window writes
    nothing through mappings, its state moved by O_DIRECT, part of that written).
    Just before, the rank writes `marker` (where it died), so a test knows the
    kill came from inside the step.
    """
    step, rank, window, point = where.split(":")
    if int(rank) != trainer.world.rank or not first_attempt():
        return
    assert point in ("stepped", "writing"), point
    streamer = _streamer(trainer)
    step_windows, raw_step = streamer._step_windows, streamer._raw_step
    write, release = streamer._write, streamer.files.release
    count = [0, 1, -1]  # windows stepped so far in this step, how many it has, the one to kill
    doomed: list[list[torch.Tensor]] = []  # that window's write, as handed to the I/O thread

    def die(detail: str) -> None:
        where = {"step": int(step), "rank": int(rank), "pid": os.getpid(), "point": detail}
        marker.write_text(json.dumps(where))
        os.kill(os.getpid(), signal.SIGKILL)

    def step_windows_then(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        only = kwargs.get("only", args[0] if args else None)
        count[:2] = [0, len(streamer.windows(optimizer, only))]
        return step_windows(optimizer, *args, **kwargs)

    def raw_step_then(optimizer: Any) -> Any:
        out = raw_step(optimizer)
        index = count[0]
        count[0] += 1
        if trainer.state.global_step + 1 == int(step) and index == int(window) % count[1]:
            if point == "stepped":
                die(f"stepped window {index} of {count[1]}")
            count[2] = index
        return out

    def write_then(tensors: list[torch.Tensor], grads: Any = None) -> None:
        if count[2] >= 0 and not doomed and tensors:
            doomed.append(tensors)
        write(tensors, grads)

    direct_write = streamer.direct.write

    def direct_write_then(window: Any) -> None:
        """The doomed window's O_DIRECT write, where it has no mapped one: half its state
        written by the direct writer's thread, then the kill."""
        if count[2] >= 0 and not doomed and point == "writing":
            doomed.append([])  # this window is the doomed one: no mapped write will be
            entries, whole = window.entries, window.write
            half = max(1, len(entries) // 2)

            def write_half(opener: Any, lanes: Any) -> None:
                window.entries = entries[:half]
                whole(opener, lanes)
                die(f"writing window {count[2]} of {count[1]}: {half} of {len(entries)} direct")

            window.write = write_half
        direct_write(window)

    def is_doomed(tensors: list[torch.Tensor]) -> bool:
        """The doomed window's write (its tensors first; its gradients may follow)."""
        first = doomed[0] if doomed else []
        return (
            bool(first)
            and len(tensors) >= len(first)
            and all(a is b for a, b in zip(tensors, first))
        )

    def release_then(tensors: list[torch.Tensor]) -> None:
        if not is_doomed(tensors):
            return release(tensors)
        half = max(1, len(tensors) // 2)
        release(tensors[:half])
        die(f"writing window {count[2]} of {count[1]}: {half} of {len(tensors)} tensors")

    streamer._step_windows = step_windows_then  # type: ignore[method-assign]
    streamer._raw_step = raw_step_then
    streamer._write = write_then  # type: ignore[method-assign]
    streamer.direct.write = direct_write_then  # type: ignore[method-assign]
    streamer.files.release = release_then  # type: ignore[method-assign]


def offload_report(trainer: Trainer, out: Path) -> None:
    """Write where this rank's offloaded state lives, as the kernel sees it: its pid, its
    scratch directory, every file of the offload parent this process maps or holds open,
    and the parent's directories now (each named after its owner's pid)."""
    files = _streamer(trainer).files
    parent = files.parent.resolve()
    mapped = {
        line.split(maxsplit=5)[5]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith(str(parent))
    }
    opened = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(parent)):
                opened.add(target)
    report = {
        "pid": os.getpid(),
        "directory": str(files.directory.resolve()),
        "files_used": sorted(mapped | opened),
        "parent_now": sorted(p.name for p in parent.iterdir()),
    }
    out.write_text(json.dumps(report))
