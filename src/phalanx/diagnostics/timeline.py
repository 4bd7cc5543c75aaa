"""A per-rank timeline of a training job, merged into one Chrome trace (Perfetto, chrome://tracing).

Turned on by `PHALANX_TIMELINE=path` (or the Trainer's `timeline=`). Each
rank records spans in memory: forward, backward, each bucket's flight from
launch to completion (with its bytes), the end-of-backward wait, every
optimizer step (the Trainer's, or a script's own through torch's global step
hooks: optimizer_spans.py), checkpoint saves, barriers. A bucket's completion time comes
from its collective's own completion callback, on the communication thread,
not from the moment someone waited for it. At exit each rank writes its spans
next to `path`, and rank 0 merges every rank's file into `path`: one track
per rank and one per rank's communication, plus per step the two numbers that
explain a step's cost:

- *exposed* communication: how long the end of backward waited on buckets;
- *hidden* communication: the part of the buckets' flights that overlapped
  backward.

Recording costs a `perf_counter_ns` and a tuple per span; when the timeline
is off, every hook is a check of one attribute that is None
(benchmarks/timeline_cost.py measures both).

What a rank keeps is capped, so a long run cannot grow without bound: the
first MAX_SPANS spans and the first MAX_STEPS step records. Past either cap
the rest are counted, not kept; the counts go into the rank file and the merged
trace (`dropped_spans`, `dropped_steps`), and the rank says so on stderr at exit.

A timeline belongs to what records into it: the Trainer makes one and hands it
to the wrappers it builds; a hand loop's DDP wrapper makes its own at its first
training forward when none was handed to it (`start`), a fully_shard root at its
first forward.
Each timeline writes its own rank file (named per recorder) at exit; the merge
puts every file of a rank on that rank's tracks, so two wrappers in one
process, or a wrapper rebuilt by a live recovery, land in one trace. Imports
no torch: `phalanx bench` reads what it writes; the merge is trace.py's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.diagnostics.trace import merge, rank_files
from phalanx.ground.safe_files import create_file

ENV = "PHALANX_TIMELINE"
STOP_ENV = "PHALANX_BENCH_STEPS"
"""Set by `phalanx bench`: the script ends (SystemExit(0)) at the first forward after
this many synced steps, on every rank at the same step."""
# About 20 spans per step: 200k spans keep the first ~10k steps (tens of MB) of a long
# run and then stop recording, rather than grow without bound.
MAX_SPANS = 200_000
# The step records' horizon, the spans' own: each holds its collectives' flights (about
# 2 KB a step, which went on growing after the spans' cap before this one).
MAX_STEPS = 10_000


@dataclass
class StepRecord:
    """The numbers of one synced backward, for the per-step summary."""

    step: int
    backward: tuple[int, int] = (0, 0)
    """(start, end) of backward, end being the start of the final wait."""
    exposed_ns: int = 0
    """Time the training thread waited for communication: the end of backward's wait, and
    under stage 3 every wait for a gather or a reduction (forward's included)."""
    flights: list[tuple[int, int, int]] = field(default_factory=list)
    """(launch, completion, bytes) of each collective: DDP's buckets, stage 3's gathers and
    reductions."""
    samples: int = 0
    """Samples through the training forwards of this step (their first input's batch dim)."""
    window_start: int = 0
    """Start of the step's first forward that communicated (stage 3's gathers), else 0."""

    def hidden_ns(self) -> int:
        """Flight time that overlapped compute: the forwards (from the first one that sent
        something) and the backward."""
        start, end = self.backward
        start = min(start, self.window_start) if self.window_start else start
        return sum(max(0, min(done, end) - max(launch, start)) for launch, done, _ in self.flights)


class Timeline:
    """This rank's spans; `write` dumps them, and rank 0's `merge` makes the trace."""

    def __init__(
        self, path: str | Path, rank: int, world_size: int, stop_after: int | None = None
    ) -> None:
        self.path = Path(path)
        self.rank = rank
        self.world_size = world_size
        self.stop_after = stop_after
        """End the script at the first forward after this many steps (`phalanx bench`)."""
        self.origin_ns = time.time_ns() - time.perf_counter_ns()  # wall clock of perf 0
        self.tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        """This recorder's part of its rank file's name: the process, then a random id."""
        self.spans: list[tuple[str, str, int, int, dict[str, Any]]] = []
        self.steps: list[StepRecord] = []
        """The first MAX_STEPS synced steps' records."""
        self.synced_steps = 0
        """Every synced step, kept or not."""
        self.dropped_spans = 0
        """Spans past MAX_SPANS: counted, not kept."""
        self._lock = threading.Lock()  # completion callbacks run on the communication thread
        self._open: dict[str, int] = {}  # spans in progress on the training thread, by name
        self._current: StepRecord | None = None
        self._samples = 0  # samples of the forwards since the last step ended
        # What stage 3's forwards waited for and sent before the step's backward began.
        self._pending = StepRecord(-1)

    # --------------------------------------------------------------- recording
    def add(self, name: str, track: str, start_ns: int, end_ns: int, **args: Any) -> None:
        with self._lock:
            if len(self.spans) < MAX_SPANS:
                self.spans.append((name, track, start_ns, end_ns - start_ns, args))
            else:
                self.dropped_spans += 1

    @contextmanager
    def span(self, name: str, track: str = "compute", **args: Any) -> Iterator[None]:
        start = time.perf_counter_ns()
        self._open[name] = self._open.get(name, 0) + 1
        try:
            yield
        finally:
            self._open[name] -= 1
            self.add(name, track, start, time.perf_counter_ns(), **args)

    def is_open(self, name: str) -> bool:
        """Whether a span called `name` is in progress (the optimizer hooks' test)."""
        return self._open.get(name, 0) > 0

    @contextmanager
    def forward(self, samples: int) -> Iterator[None]:
        """A training forward of `samples` samples; under `phalanx bench`, maybe the end."""
        if self.stop_after is not None and self.synced_steps >= self.stop_after:
            raise BenchStop(self.synced_steps)
        self._samples += samples
        with self.span("forward", samples=samples):
            yield

    @contextmanager
    def local_backward(self, sync: bool) -> Iterator[None]:
        """A backward with no reducer (a one-rank Trainer): a step with nothing to wait for."""
        if not sync:
            with self.span("backward (accumulate)"):
                yield
            return
        self.backward_started()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            self.backward_waited(end, end)

    def backward_started(self) -> None:
        pending, self._pending = self._pending, StepRecord(-1)
        self._current = StepRecord(
            self.synced_steps,
            (time.perf_counter_ns(), 0),
            exposed_ns=pending.exposed_ns,
            flights=pending.flights,
            window_start=pending.window_start,
        )
        self._current.samples, self._samples = self._samples, 0

    def bucket_launched(self, index: int, nbytes: int, future: Any) -> None:
        """Record a bucket's flight; `future` (or None) says when its collective completed."""
        self.flight(f"bucket {index}", nbytes, future)

    def flight(self, name: str, nbytes: int, future: Any) -> None:
        """Record a collective's flight from now; `future` (or None: now) says when it
        completed. It counts in the step running, or in the next one's forwards."""
        launch = time.perf_counter_ns()
        record = self._current if self._current is not None else self._pending
        if record is self._pending and not record.window_start:
            record.window_start = launch

        def done(*_: Any) -> None:
            end = time.perf_counter_ns()
            self.add(name, "comm", launch, end, bytes=nbytes)
            with self._lock:
                record.flights.append((launch, end, nbytes))

        if future is None:
            done()
        else:
            future.add_done_callback(done)

    def comm_waited(self, name: str, start_ns: int, end_ns: int) -> None:
        """The training thread waited for a collective (stage 3's gathers and reductions)."""
        self.add(name, "compute", start_ns, end_ns)
        record = self._current if self._current is not None else self._pending
        record.exposed_ns += end_ns - start_ns

    def backward_waited(self, wait_start: int, wait_end: int) -> None:
        record = self._current
        if record is None:
            return
        record.backward = (record.backward[0], wait_start)
        record.exposed_ns += wait_end - wait_start
        self.add("backward", "compute", record.backward[0], wait_start)
        self.add("wait for buckets", "compute", wait_start, wait_end)
        if len(self.steps) < MAX_STEPS:
            self.steps.append(record)
        self.synced_steps += 1
        self._current = None

    @property
    def dropped_steps(self) -> int:
        """Synced steps past MAX_STEPS: counted, not kept."""
        return self.synced_steps - len(self.steps)

    # ------------------------------------------------------------------ output
    def rank_file(self) -> Path:
        """This timeline's file, next to `path`: `<name>.rank-<rank>.<pid>-<id>.json`."""
        return self.path.with_name(f"{self.path.name}.rank-{self.rank}.{self.tag}.json")

    def clear_stale_files(self) -> None:
        """Remove this rank's files left by other processes (an earlier run or attempt at
        the same path), so the merge cannot mix them in; this process's are kept."""
        mine = f".rank-{self.rank}.{os.getpid()}-"
        for stale in rank_files(self.path, self.rank):
            if mine not in stale.name:
                with contextlib.suppress(OSError):
                    stale.unlink()

    def write(self) -> None:
        """This rank's spans and step numbers, next to `path`."""
        data = {
            "rank": self.rank,
            "origin_ns": self.origin_ns,
            "truncated": bool(self.dropped_spans or self.dropped_steps),
            "dropped_spans": self.dropped_spans,
            "dropped_steps": self.dropped_steps,
            "spans": self.spans,
            "steps": [
                {
                    "step": s.step,
                    "at_ns": s.backward[0],
                    "exposed_ms": s.exposed_ns / 1e6,
                    "hidden_ms": s.hidden_ns() / 1e6,
                    "bytes": sum(b for *_, b in s.flights),
                    "backward_ms": (s.backward[1] - s.backward[0]) / 1e6,
                    "samples": s.samples,
                }
                for s in self.steps
            ],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        final = self.rank_file()
        tmp, file = create_file(final.parent, final.name)  # random, O_EXCL|O_NOFOLLOW
        with file:
            file.write(json.dumps(data).encode())
        os.replace(tmp, final)


def span_of(timeline: Timeline | None, name: str) -> AbstractContextManager[None]:
    """`timeline.span(name)`, or nothing when the timeline is off."""
    return nullcontext() if timeline is None else timeline.span(name)


def forward_of(timeline: Timeline | None, samples: int) -> AbstractContextManager[None]:
    return nullcontext() if timeline is None else timeline.forward(samples)


def local_backward_of(timeline: Timeline | None, sync: bool) -> AbstractContextManager[None]:
    return nullcontext() if timeline is None else timeline.local_backward(sync)


class BenchStop(SystemExit):
    """`phalanx bench` has its steps: the script ends here, cleanly, on every rank.

    Raised from the first training forward after `stop_after` synced steps.
    Every rank counts the same synced steps, so every rank stops at the same
    forward, between collectives; the exit hook then writes the timeline.
    """

    def __init__(self, steps: int) -> None:
        super().__init__(0)
        self.steps = steps


def start(path: str | Path, rank: int, world_size: int) -> Timeline:
    """A new timeline at `path` for the caller that records into it, written (and, on rank
    0, merged) at exit. Every optimizer step of the process is timed in it."""
    stop = os.environ.get(STOP_ENV)
    timeline = Timeline(path, rank, world_size, int(stop) if stop else None)
    timeline.clear_stale_files()
    atexit.register(_finish, timeline)
    # A script's own opt.step() too (the one module here that imports torch, imported
    # only by a process that records, which has torch already).
    from phalanx.diagnostics.optimizer_spans import time_optimizer_steps

    time_optimizer_steps(timeline)
    return timeline


def from_env(rank: int, world_size: int) -> Timeline | None:
    """A new timeline where `PHALANX_TIMELINE` asks for one, or None when it is unset."""
    path = os.environ.get(ENV)
    return start(path, rank, world_size) if path else None


def _finish(timeline: Timeline) -> None:
    timeline.write()
    if timeline.dropped_spans or timeline.dropped_steps:
        with contextlib.suppress(OSError, ValueError):  # stderr may be gone at exit
            print(
                f"[phalanx] timeline, rank {timeline.rank}: kept the first {len(timeline.spans)} "
                f"spans and {len(timeline.steps)} steps (the cap that bounds its memory); "
                f"{timeline.dropped_spans} spans and {timeline.dropped_steps} steps after "
                "them were counted, not kept",
                file=sys.stderr,
                flush=True,
            )
    if timeline.rank == 0:
        merge(timeline.path, timeline.world_size)
