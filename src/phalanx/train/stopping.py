"""Stopping on request: SIGTERM (a scheduler's preemption) or Ctrl-C saves the work first.

Without this, a preempted job loses every step since its last periodic save.
While `train()` runs, SIGTERM and SIGINT only record that a stop was asked
for. The signal reaches ranks at slightly different times, so acting on it
at once would stop them at different steps; instead, at every step boundary
the ranks all-reduce their flags (one tiny all-reduce per step), and when
any rank was asked, every rank stops after the same step, a checkpoint is
written at that step, and `train()` raises `TrainingStopped`: a `SystemExit`
with the status a shell gives a process the signal ended (128 + its number),
which a launcher or scheduler reads as "stopped by the signal".

A save being written in the background when the ranks agree to stop is
completed first, then the stop's own save is written (unless it is the same
step), then the exit. A second Ctrl-C stops at once (KeyboardInterrupt), while
the first one's save is still running if need be: the checkpoint being written
is then left as a `.tmp` directory, which is never loaded.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NamedTuple

from phalanx.runtime import World
from phalanx.runtime.ignored import warn_ignored

STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(SystemExit):
    """`train()` stopped on SIGTERM or SIGINT after saving a checkpoint at `step`.

    A SystemExit: left uncaught, the process exits quietly with 128 + the
    signal's number; catch it to do more before exiting.
    """

    def __init__(
        self, signum: int, step: int, checkpoint: str, received_by: list[int] | None = None
    ) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.received_by = received_by or []
        """The ranks the signal reached (the others stopped because they did)."""

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        ranks = ", ".join(str(r) for r in self.received_by)
        who = f" (received by rank{'s' if len(self.received_by) > 1 else ''} {ranks})"
        return (
            f"stopped by {name}{who if ranks else ''} at step {self.step}; saved {self.checkpoint}"
        )


class StopRequests:
    """SIGTERM and SIGINT received while installed; the ranks agree on them at step boundaries."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.enabled = False
        """Whether the ranks agree at each step boundary (the same on every rank)."""
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    @contextmanager
    def installed(self, enabled: bool) -> Iterator[None]:
        """Record the two signals inside the block (main thread only); then the old handlers."""
        self.enabled, self.received = enabled, []
        # Off the main thread no handler can be set, but the rank still agrees at every
        # step (the others may be signalled).
        if enabled and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        elif enabled:  # Ray Train runs the function in a thread of its worker actor
            warn_ignored(
                "save_on_signal cannot catch SIGTERM or Ctrl-C here: train() runs off the "
                f"main thread ({threading.current_thread().name}), where Python sets no "
                "signal handler — a stop loses the steps since the last checkpoint; bound "
                "them with save_steps (under Ray Train a restart resumes the last one)",
                self.world.rank,
            )
        try:
            yield
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            self._previous, self.enabled = {}, False

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        # Only a note: printing here could re-enter a write the signal interrupted.
        if signum == signal.SIGINT and signal.SIGINT in self.received:
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.SIG_DFL))
            raise KeyboardInterrupt  # the second Ctrl-C: stop at once
        self.received.append(signum)

    def agree(
        self, writing: bool | None = None, grow: bool | None = None
    ) -> tuple[Stop | None, bool, bool]:
        """Collective at a step boundary: the signal every rank stops for, and the ranks that
        received it (None to go on; SIGTERM wins over SIGINT when ranks received different
        ones); whether every rank's background save has ended; and whether any rank lets a
        waiting replacement in here.

        `writing`: None when no save is in flight (the same on every rank), else whether
        this rank's part of it has ended. It rides on the same all-reduce, so every rank
        collects the save at the same step, and costs a collective of its own only when
        stops are not agreed (save_on_signal=False) and a save is in flight. `grow`: None
        without live recovery, else whether this rank (rank 0) saw a replacement waiting:
        on the same all-reduce, so every member leaves at this boundary together.
        """
        if not self.enabled and writing is None and grow is None:
            return None, False, False
        world, rank = self.world.world_size, self.world.rank
        signals = STOP_SIGNALS if self.enabled else ()
        mine = [0.0] * (world * len(signals)) + ([float(writing)] if writing is not None else [])
        mine += [float(grow)] if grow is not None else []
        for k, signum in enumerate(signals):
            mine[k * world + rank] = float(signum in self.received)
        votes = self.world.all_reduce_sum(mine) if self.world.is_distributed else mine
        grown = grow is not None and votes.pop() > 0
        written = writing is not None and votes[-1] == world
        for k, signum in enumerate(signals):
            ranks = [r for r in range(world) if votes[k * world + r]]
            if ranks:
                return Stop(signum, ranks), written, grown
        return None, written, grown


class Stop(NamedTuple):
    """What the ranks agreed to stop for."""

    signum: int
    received_by: list[int]
