"""The workers of one attempt on this node: how each is started, where its output goes,
and how the group is stopped so that nothing it forked is left running."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from phalanx.launch.forkstart import fresh_process
from phalanx.launch.lifeline import Lifeline
from phalanx.launch.output import OutputSink, RankOutput, StreamTarget, open_log
from phalanx.launch.procgroup import exit_code_of, live_groups, signal_group
from phalanx.launch.routing import ERR, OUT, OutputRouting
from phalanx.launch.terminal import open_bar_pty

# How long to wait for a worker's pipes to drain after it exited; only a grandchild
# that left the worker's process group can keep them open longer.
_DRAIN_TIMEOUT_S = 3.0
_STOP_POLL_S = 0.05


@dataclass
class StopRequest:
    """Signals the launcher received; set by the handler, read by the supervise loop."""

    signums: list[int] = field(default_factory=list)

    @property
    def signum(self) -> int | None:
        return self.signums[0] if self.signums else None


class WorkerProcess(Protocol):
    """What the launcher uses of a worker's process: a Popen, or a ForkedProcess
    (launch/forkstart.py) when a warm server forked it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Start = Callable[[list[str], dict[str, str], int, int], WorkerProcess]
"""Starts a worker: argv, env, its stdout and stderr descriptors."""


@dataclass
class Worker:
    rank: int
    local_rank: int
    process: WorkerProcess
    output: RankOutput

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_status(self) -> int | None:
        """Popen's returncode (negative for a signal), or None while it runs."""
        return self.process.poll()

    def stderr_tail(self) -> list[str]:
        return self.output.stderr_tail()


def wait_for_an_exit(workers: Iterable[Worker], timeout_s: float) -> None:
    """Return when one of `workers` (running when last polled) exits, or after `timeout_s`.

    The supervise loops wait here instead of sleeping, so a lost worker is seen when it
    exits, not up to a poll later: live recovery's survivors wait on that report. Each
    worker is watched through a pidfd; where there is none (Linux < 5.3, or the worker
    already reaped) this is a plain sleep.
    """
    fds: list[int] = []
    try:
        for worker in workers:
            with contextlib.suppress(OSError, AttributeError):
                fds.append(os.pidfd_open(worker.pid))
        if not fds:
            time.sleep(timeout_s)
            return
        watch = select.poll()  # poll, not select: no limit on the descriptors' numbers
        for fd in fds:
            watch.register(fd, select.POLLIN)
        watch.poll(timeout_s * 1000)
    finally:
        for fd in fds:
            os.close(fd)


@dataclass(frozen=True)
class Failure:
    """The first worker that failed, as the summary reports it."""

    worker: Worker
    returncode: int

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.returncode)


@dataclass
class OutputPlan:
    """Where this attempt's output goes: the flags, and the files they name."""

    routing: OutputRouting
    log_dir: Path | None  # --log-dir: rank_<rank>.log, unprefixed, both streams
    attempt_dir: Path | None  # torchrun's per-stream logs (-r/-t), when any
    header: str | None  # a restart appends after this line
    filtered: dict[int, IO[bytes]] = field(default_factory=dict)  # stream -> filtered log

    def targets(
        self, rank: int, local_rank: int
    ) -> tuple[list[IO[bytes]], StreamTarget, StreamTarget]:
        """The files this worker's pumps own, and its stdout and stderr targets."""
        owned: list[IO[bytes]] = []
        combined = []
        if self.log_dir is not None:
            combined.append(open_log(self.log_dir / f"rank_{rank}.log", self.header))
            owned += combined
        made = []
        for stream, name in ((OUT, "stdout"), (ERR, "stderr")):
            files = list(combined)
            if self.attempt_dir is not None and self.routing.to_file(local_rank, stream):
                files.append((self.attempt_dir / str(local_rank) / f"{name}.log").open("wb"))
                owned.append(files[-1])
            needles = self.routing.duplicate_filters.get(stream, ())
            made.append(
                StreamTarget(
                    console=self.routing.to_console(local_rank, stream),
                    files=files,
                    filtered=self.filtered.get(stream),
                    needles=tuple(n.encode() for n in needles),
                )
            )
        return owned, made[0], made[1]

    def close(self) -> None:
        for log in self.filtered.values():
            log.close()


def spawn_worker(
    argv: list[str],
    env: dict[str, str],
    rank: int,
    local_rank: int,
    sink: OutputSink,
    plan: OutputPlan,
    start: Start = fresh_process,
) -> Worker:
    """Start one worker in its own session, its output pumped to the sink and its files.

    Global rank 0 draws its progress bar on a pty when the console is a terminal.
    """
    owned, out_target, err_target = plan.targets(rank, local_rank)
    bar = open_bar_pty(sink.stderr, len(f"[rank {rank}] ")) if rank == 0 else None
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe() if bar is None else bar
    try:
        process = start(argv, env, out_write, err_write)
    except OSError:
        for log in owned:
            log.close()
        os.close(out_read)
        os.close(err_read)
        raise
    finally:  # the worker holds the write ends; EOF comes when it (and its children) are gone
        os.close(out_write)
        os.close(err_write)
    stdout = open(out_read, "rb")  # noqa: SIM115 - the pump owns it until EOF
    stderr: IO[bytes] | int = err_read if bar is not None else open(err_read, "rb")  # noqa: SIM115
    output = RankOutput(rank, stdout, stderr, sink, (out_target, err_target), owned)
    return Worker(rank, local_rank, process, output)


class WorkerGroup:
    """The workers of one attempt on this node."""

    def __init__(self, workers: list[Worker], lifeline: Lifeline) -> None:
        """`workers` are already on the lifeline's watch list (see `Agent._spawn`)."""
        self.workers = workers
        self._lifeline = lifeline

    def first_failure(self) -> Failure | None:
        """The lowest-ranked worker found failed in this sweep, if any."""
        for worker in self.workers:
            code = worker.process.poll()
            if code is not None and code != 0:
                return Failure(worker, code)
        return None

    def all_succeeded(self) -> bool:
        return all(w.process.poll() == 0 for w in self.workers)

    def wait(self, timeout_s: float) -> None:
        """Until a running worker exits, or `timeout_s` (wait_for_an_exit)."""
        wait_for_an_exit([w for w in self.workers if w.process.returncode is None], timeout_s)

    def stop(self, first_signal: int, grace_s: float, stop: StopRequest) -> None:
        """Signal every group, wait up to `grace_s` for them to go, then SIGKILL what is left.

        Groups of workers that already exited are signalled too: their children
        may still run. A second signal to the launcher skips the grace period.
        """
        signals_before = len(stop.signums)
        for worker in self.workers:
            signal_group(worker.pid, first_signal)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(stop.signums) == signals_before:
            if not self._any_alive():
                break
            time.sleep(_STOP_POLL_S)
        for worker in self.workers:
            signal_group(worker.pid, signal.SIGKILL)
        for worker in self.workers:
            worker.process.wait()
            self._lifeline.release(worker.pid)

    def await_exit(self, grace_s: float) -> None:
        """Give the workers up to `grace_s` to exit by themselves (a preemption save done)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(w.process.poll() is None for w in self.workers):
            time.sleep(_STOP_POLL_S)

    def _any_alive(self) -> bool:
        # poll() reaps the workers themselves, so only their descendants can keep a group alive.
        if any(w.process.poll() is None for w in self.workers):
            return True
        return bool(live_groups({w.pid for w in self.workers}))

    def drain_output(self) -> None:
        """Let the pumps pass on the workers' last lines, within one shared deadline."""
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        for worker in self.workers:
            worker.output.join(max(0.0, deadline - time.monotonic()))
