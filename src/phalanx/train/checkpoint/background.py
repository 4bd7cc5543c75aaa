"""The thread that writes a staged checkpoint while training goes on, one save at a time.

Why a thread: the writing is file I/O and hashing, which release the GIL, and
torch.save's pickling of a state dict is small beside its tensors' bytes; a
thread shares the staged copy without a second one. A writer process would
need the state in shared memory (one more copy, or a fork whose copy-on-write
faults land in the next steps); benchmarks/async_save.py measures both, and
docs/trainer.md, "Background saves", gives the figures.

Why niced: on a host whose cores are all training, the writer competes with
the steps for them; a lower priority (WRITER_NICE) gives the steps their time
first, and the write what they leave.

Why its own group: the write still meets the other ranks (DCP's plan for
sharded state; the agreement that every rank wrote its part before rank 0
seals). Those collectives run on this thread while the training thread issues
its own, so they go over a gloo group of their own, made once (a collective of
every rank, at the first background save): two threads never share a group,
and each group sees its collectives in the same order on every rank. Under live
recovery it is made once per generation (runtime/live_side.py), and a write
in flight when its generation ends (a member lost, a replacement let in) fails
within a slice instead of waiting on a member that will not answer: the loop
settles it before it recovers (train/loop.py), and the next save writes again.

The outcome (the `Saved`, or the one error every rank raised together) is kept
until the training thread asks for it, at a step boundary all ranks agree on
(the Trainer's vote, stopping.py), so every rank reports it at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from phalanx.runtime import World
from phalanx.runtime.live import current_live_group
from phalanx.runtime.live_side import SideGroup

T = TypeVar("T")

WRITER_NICE = 10
"""How much lower the writer thread's priority is than training's (Linux's per-thread nice):
where the cores are all busy, the kernel gives the steps their time first and the write
what they leave (benchmarks/async_staging.py measured the step time with and without)."""


class BackgroundWriter(Generic[T]):
    """At most one write in flight, on a daemon thread, over the writers' own group."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._writers: dist.ProcessGroup | None = None
        """The writers' own gloo group (made at the first save), over the run's ranks; under
        live recovery, over the current generation's members (remade after a change)."""
        self._thread: threading.Thread | None = None
        self._result: T | None = None
        self._error: BaseException | None = None
        self.step: int | None = None
        """The step of the save in flight (or finished and not yet collected)."""

    def writers_world(self, timeout_s: float | None = None) -> World:
        """The World the writes use: the same ranks over a gloo group of their own, whose
        collectives may block `timeout_s` (torch's default: None).

        Collective the first time (every rank makes the group together)."""
        live, writers = current_live_group(), self._writers
        if live is not None:
            if not isinstance(writers, SideGroup) or writers.generation != live.generation:
                writers = SideGroup(live, "writers")
        elif writers is None:
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            writers = dist.new_group(backend="gloo", timeout=timeout)
            assert writers is not None  # every rank is a member
        self._writers = writers
        # Made from the run's World at each call, never kept: it has the run's rank.
        cpu = torch.device("cpu")
        return dataclasses.replace(self.world, process_group=writers, device=cpu, backend="gloo")

    @property
    def in_flight(self) -> bool:
        """A save started and not yet collected (the same on every rank)."""
        return self.step is not None

    def done(self) -> bool:
        """Whether this rank's part of the save in flight has ended (True when none is)."""
        return self._thread is None or not self._thread.is_alive()

    def wait_written(self) -> None:
        """Wait until this rank's part of the save in flight has ended, without collecting it
        (live recovery lets a replacement in only then: its generation's end would fail it)."""
        if self._thread is not None:
            self._thread.join()

    def start(self, step: int, write: Callable[[], T]) -> None:
        """Run `write` on the writer thread; the previous save must have been collected."""
        assert self.step is None, "one save in flight at a time: collect the previous first"
        self.step, self._result, self._error = step, None, None

        def run() -> None:
            _lower_priority()
            try:
                self._result = write()
            except BaseException as exc:  # kept for the training thread, which raises it
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"phalanx-save-{step}", daemon=True)
        self._thread.start()

    def collect(self) -> tuple[T, float]:
        """Wait for the save in flight; its result and the seconds waited here, or its
        error (raised on every rank alike: the write agreed on it)."""
        assert self.step is not None and self._thread is not None
        started = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - started
        result, error = self._result, self._error
        self.step, self._thread, self._result, self._error = None, None, None, None
        if error is not None:
            raise error
        assert result is not None
        return result, waited


def _lower_priority() -> None:
    """This thread's nice raised by WRITER_NICE (never lowered: that needs privileges, and a
    job run under nice keeps its own); where the system has no per-thread nice, nothing."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + WRITER_NICE))
