"""Where each rank stands (step, collective count, last collective), readable from outside.

When one rank stalls, its peers wait in the next collective until the timeout
and the first process to die is a healthy one: torch then reports the rank that
waited, never the one that did not come. With a record of every rank's
position, `phalanx launch` names the rank(s) that did not arrive, the
collective each rank stood at, and the stuck ranks' Python stacks.

`start()` (called by `phalanx.init()`) opens this process's record: a small
file mapped into memory, in the directory `phalanx launch` passes in
PHALANX_PROGRESS_DIR, or anonymous memory under other launchers. The reducer
and the Trainer update it with one call each (`collective`, `step`): a few
stores into the mapping, about a microsecond, guarded by a sequence number so
a reader never sees half an update (benchmarks/progress_record.py measures it).

Under `phalanx launch` a signal (recorded in the file) makes the process dump
its Python stacks to a file beside the record, which the launcher collects
before it stops the workers. Under torchrun, srun or mpirun, where nobody
collects, a watchdog thread prints the rank's own position and stacks once it
has made no collective progress for most of the collective timeout, just
before its peers fail.

Imports no torch: the launcher reads the records with `read_record`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "PROGRESS_DIR_VAR",
    "Position",
    "collective",
    "note_stop",
    "read_record",
    "read_stop",
    "record_path",
    "stacks_path",
    "start",
    "step",
]

PROGRESS_DIR_VAR = "PHALANX_PROGRESS_DIR"
_MAGIC = 0x50484C58  # "PHLX"
# magic, sequence, pid, rank, dump signal, step, iteration, collectives, updated, exiting
# (time.time() both; exiting 0.0 until the interpreter begins to exit).
_FIELDS = struct.Struct("=IIiiiqqqdd")
_LABEL_BYTES = 64
_SIZE = _FIELDS.size + _LABEL_BYTES
_SEQ_OFFSET = 4
_SEQ = struct.Struct("=I")
_BODY = struct.Struct("=qqqd")  # step, iteration, collectives, updated
_BODY_OFFSET = 20
_EXITING = struct.Struct("=d")
_EXITING_OFFSET = _BODY_OFFSET + _BODY.size
_LABEL_OFFSET = _FIELDS.size
# The watchdog speaks at this share of the timeout: the stuck rank then reports before
# its peers' collectives fail and a launcher (torchrun, srun) kills it.
_REPORT_AT = 0.8
_WATCH_EVERY_S = 1.0
_READ_TRIES = 100


def _dump_signal() -> int:
    """A real-time signal nobody else uses (SIGUSR1/2 are SLURM's and Lightning's)."""
    sigrtmin = getattr(signal, "SIGRTMIN", None)
    return int(sigrtmin) + 4 if sigrtmin is not None else int(signal.SIGUSR2)


def record_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank}.progress"


def stacks_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank}.stacks"


def stop_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank}.stopped"


class _Recorder:
    """This process's record; every update is a handful of stores into the mapping."""

    def __init__(self, rank: int, directory: Path | None) -> None:
        if directory is None:
            self._map = mmap.mmap(-1, _SIZE)
        else:
            with record_path(directory, rank).open("w+b") as f:
                f.truncate(_SIZE)
                self._map = mmap.mmap(f.fileno(), _SIZE)
        self.rank = rank
        self.pid = os.getpid()
        self.step = self.iteration = self.collectives = 0
        self.label = b""
        self.updated = time.time()
        self._seq = 0
        self.dump_signal = 0
        self._labels: dict[str, bytes] = {}
        _FIELDS.pack_into(self._map, 0, _MAGIC, 0, self.pid, rank, 0, 0, 0, 0, self.updated, 0.0)

    def set_dump_signal(self, signum: int) -> None:
        self.dump_signal = signum
        struct.pack_into("=i", self._map, 16, signum)

    def _publish(self, label: bytes | None) -> None:
        self.updated = time.time()
        self._next_seq()  # odd: an update is under way
        _BODY.pack_into(
            self._map, _BODY_OFFSET, self.step, self.iteration, self.collectives, self.updated
        )
        if label is not None:
            self._map[_LABEL_OFFSET : _LABEL_OFFSET + _LABEL_BYTES] = label
        self._next_seq()

    def _next_seq(self) -> None:
        """The sequence number a reader checks: odd while an update is under way."""
        self._seq += 1
        _SEQ.pack_into(self._map, _SEQ_OFFSET, self._seq)

    def collective(self, name: str, index: int, iteration: int) -> None:
        label = self._labels.get(name)
        if label is None:
            label = self._labels[name] = name.encode()[: _LABEL_BYTES - 8]
        self.collectives += 1
        self.iteration = iteration
        self.label = label + b" %d" % index if index >= 0 else label
        self._publish(self.label.ljust(_LABEL_BYTES, b"\0"))

    def set_step(self, value: int) -> None:
        self.step = value
        self._publish(None)

    def exiting(self) -> None:
        """The interpreter has begun to exit: from now on the process only tears down. Not
        in a forked child (a DataLoader worker): the record is its parent's."""
        if os.getpid() != self.pid:
            return
        self._next_seq()
        _EXITING.pack_into(self._map, _EXITING_OFFSET, time.time())
        self._next_seq()


_recorder: _Recorder | None = None  # one per process, like faulthandler's own state


def start(rank: int, world_size: int, timeout_s: float) -> None:
    """Open this process's record (idempotent). Under `phalanx launch`, also arm the stack
    dump the launcher asks for; elsewhere, start the watchdog that reports a stall (not
    in a world of one, which has no peer to stall)."""
    global _recorder
    if _recorder is not None:
        return
    raw = os.environ.get(PROGRESS_DIR_VAR)
    directory = Path(raw) if raw else None
    try:
        _recorder = _Recorder(rank, directory)
    except OSError:  # an unwritable directory costs the diagnosis, never the job
        _recorder = _Recorder(rank, None)
        directory = None
    if directory is not None:
        _arm_stack_dump(_recorder, stacks_path(directory, rank))
        _mark_exit(_recorder)
    elif world_size > 1:
        _Watchdog(_recorder, timeout_s).start()


def _arm_stack_dump(recorder: _Recorder, path: Path) -> None:
    signum = _dump_signal()
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return  # the script uses this signal itself: leave it alone
    stacks: IO[str] = path.open("w")  # kept open for the process's life, as faulthandler needs
    # Ignored beneath faulthandler's handler: the interpreter's finalization unregisters it
    # and restores this, so a dump asked of a process that late does nothing, where the
    # default action would kill it by the signal (a launcher asking a slow teardown for
    # its stacks then reported that rank killed by signal 38, the first to fail).
    with contextlib.suppress(ValueError):  # not the main thread: the default stays
        signal.signal(signum, signal.SIG_IGN)
    faulthandler.register(signum, file=stacks, all_threads=True)
    recorder.set_dump_signal(signum)


def _mark_exit(recorder: _Recorder) -> None:
    """Record when the teardown begins, so that a launcher can tell a process hung in its
    exit (a group's teardown that never returns) from one still at work. The moment is
    the first exit handler's, after the script's own threads have ended: the thread
    shutdown hook (which runs first at exit, whatever ended the script) registers it
    last, so it runs before every exit handler registered earlier (LIFO)."""
    register_at_shutdown = getattr(threading, "_register_atexit", None)

    def first_at_exit() -> None:
        atexit.register(recorder.exiting)

    if register_at_shutdown is None:
        first_at_exit()
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
        register_at_shutdown(first_at_exit)


def collective(name: str, index: int = -1, iteration: int = 0) -> None:
    """A collective was entered: `name` (and `index`, e.g. a bucket) in `iteration`."""
    if _recorder is not None:
        _recorder.collective(name, index, iteration)


def step(value: int) -> None:
    """The Trainer is now in optimizer step `value` (1-based)."""
    if _recorder is not None:
        _recorder.set_step(value)


def note_stop(text: str) -> None:
    """This rank stops on purpose (a preemption save done): `phalanx launch` says `text`
    instead of reporting the exit as a failure."""
    raw = os.environ.get(PROGRESS_DIR_VAR)
    if _recorder is not None and raw:
        # An unwritable note only makes the summary read as a failure: nothing is lost.
        with contextlib.suppress(OSError):
            stop_path(Path(raw), _recorder.rank).write_text(text)


def read_stop(directory: Path, rank: int) -> str | None:
    try:
        return stop_path(directory, rank).read_text()
    except OSError:
        return None


@dataclass(frozen=True)
class Position:
    """One rank's record, as a reader sees it."""

    pid: int
    rank: int
    dump_signal: int
    step: int
    iteration: int
    collectives: int
    updated: float
    label: str
    exiting: float = 0.0
    """When the interpreter began to exit (time.time()); 0.0 while the script runs."""

    def collective_text(self) -> str:
        """'#12 (ddp all_reduce bucket 0, iteration 5)': the last collective entered."""
        return f"#{self.collectives} ({self.label}, iteration {self.iteration})"

    def where(self) -> str:
        """'in step 5; last collective entered: #12 (...)', for a summary."""
        last = (
            f"last collective entered: {self.collective_text()}"
            if self.collectives
            else "no collective entered yet"
        )
        return f"in step {self.step}; {last}" if self.step else last


def read_record(path: Path) -> Position | None:
    """The record at `path`, read consistently; None when absent or not a record."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    for _ in range(_READ_TRIES):
        if len(data) < _SIZE:
            return None
        magic, seq, pid, rank, dump, step_, iteration, count, updated, exiting = (
            _FIELDS.unpack_from(data)
        )
        if magic != _MAGIC:
            return None
        if seq % 2 == 0:
            label = data[_LABEL_OFFSET:_SIZE].rstrip(b"\0").decode(errors="replace")
            return Position(pid, rank, dump, step_, iteration, count, updated, label, exiting)
        time.sleep(0.001)  # an update is under way: read again
        data = path.read_bytes()
    return None


class _Watchdog(threading.Thread):
    """Prints this rank's position and stacks once per stall (no launcher collects them)."""

    def __init__(self, recorder: _Recorder, timeout_s: float) -> None:
        super().__init__(name="phalanx-progress-watchdog", daemon=True)
        self._recorder = recorder
        self._after_s = timeout_s * _REPORT_AT
        self._timeout_s = timeout_s

    def run(self) -> None:
        reported = -1.0
        while True:
            time.sleep(_WATCH_EVERY_S)
            rec = self._recorder
            idle = time.time() - rec.updated
            # Armed by the first collective: before it, setup (loading a model, a dataset)
            # may take its time, and the stall the watchdog reports is one between peers.
            if rec.collectives and idle >= self._after_s and rec.updated != reported:
                reported = rec.updated
                self._report(idle)

    def _report(self, idle: float) -> None:
        rec = self._recorder
        where = Position(
            os.getpid(),
            rec.rank,
            0,
            rec.step,
            rec.iteration,
            rec.collectives,
            rec.updated,
            rec.label.decode(errors="replace"),
        ).where()
        try:
            print(
                f"[phalanx] rank {rec.rank}: no collective progress for {idle:.0f}s (the "
                f"collective timeout is {self._timeout_s:g}s) — it stands at {where}; if the "
                "job is stuck, this rank's Python stacks show where:",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):
            pass
