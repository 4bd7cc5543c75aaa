"""Spawn the workers of one node, watch them, stop them all when one fails, restart the group.

The agent never talks to the workers: it gives them an environment, reads
their output and their exit status, and signals their process groups. The
workers find each other through torch.distributed on their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from phalanx.errors import ConfigurationError
from phalanx.launch.config import LaunchConfig
from phalanx.launch.output import OutputSink, RankOutput
from phalanx.launch.procgroup import (
    describe_returncode,
    exit_code_of,
    live_groups,
    signal_group,
)
from phalanx.launch.rendezvous import wait_for_master
from phalanx.launch.workerenv import gloo_ifname_env, worker_argv, worker_env
from phalanx.ports import free_port

# Signals the launcher passes on to every worker group before it exits with 128 + signum.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
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


@dataclass
class Worker:
    rank: int
    local_rank: int
    process: subprocess.Popen[bytes]
    output: RankOutput


@dataclass(frozen=True)
class Failure:
    """The first worker that failed, as the summary reports it."""

    worker: Worker
    returncode: int

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.returncode)


class WorkerGroup:
    """The workers of one attempt on this node."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def first_failure(self) -> Failure | None:
        """The lowest-ranked worker found failed in this sweep, if any."""
        for worker in self.workers:
            code = worker.process.poll()
            if code is not None and code != 0:
                return Failure(worker, code)
        return None

    def all_succeeded(self) -> bool:
        return all(w.process.poll() == 0 for w in self.workers)

    def stop(self, first_signal: int, grace_s: float, stop: StopRequest) -> None:
        """Signal every group, wait up to `grace_s` for them to go, then SIGKILL what is left.

        Groups of workers that already exited are signalled too: their children
        may still run. A second Ctrl-C skips the grace period.
        """
        signals_before = len(stop.signums)
        for worker in self.workers:
            signal_group(worker.process.pid, first_signal)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(stop.signums) == signals_before:
            if not self._any_alive():
                break
            time.sleep(_STOP_POLL_S)
        for worker in self.workers:
            signal_group(worker.process.pid, signal.SIGKILL)
        for worker in self.workers:
            worker.process.wait()

    def _any_alive(self) -> bool:
        # poll() reaps the workers themselves, so only their descendants can keep a group alive.
        if any(w.process.poll() is None for w in self.workers):
            return True
        return bool(live_groups({w.process.pid for w in self.workers}))

    def drain_output(self) -> None:
        """Let the pumps pass on the workers' last lines, within one shared deadline."""
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        for worker in self.workers:
            worker.output.join(max(0.0, deadline - time.monotonic()))


class Agent:
    """Runs the job on this node: up to 1 + max_restarts attempts of the whole worker group."""

    def __init__(
        self,
        config: LaunchConfig,
        sink: OutputSink,
        environ: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.sink = sink
        self.environ = dict(os.environ if environ is None else environ)
        self.python = python
        self.stop_request = StopRequest()

    def run(self) -> int:
        """Exit status of the job: 0, the failed worker's, or 128 + signum when interrupted."""
        with self._forward_signals():
            extra = gloo_ifname_env(self.config, self.environ, self.sink.message)
            port = self.config.master_port
            for restart in range(self.config.max_restarts + 1):
                if self.config.picks_free_port:
                    port = free_port(avoid=port or None)
                status = self._attempt(restart, port, extra)
                if status is not None:
                    return status
        raise AssertionError("unreachable: the last attempt always returns a status")

    def _attempt(self, restart: int, port: int, extra: Mapping[str, str]) -> int | None:
        """One run of the worker group; None means: failed, and a restart is allowed."""
        if not self._master_reachable(port):
            return 128 + (self.stop_request.signum or signal.SIGINT)
        self._announce_start(restart, port)
        group = self._spawn(restart, port, extra)
        outcome = self._supervise(group)
        if isinstance(outcome, Failure):
            return self._after_failure(group, outcome, restart)
        # After a success too: stray children of finished workers would outlive the job.
        group.stop(outcome or signal.SIGTERM, self.config.grace_s, self.stop_request)
        group.drain_output()
        if outcome == 0:
            return 0
        self.sink.message(f"stopped by {signal.Signals(outcome).name}")
        return 128 + outcome

    def _master_reachable(self, port: int) -> bool:
        """Node 0 hosts the master itself; other nodes wait for it. False: interrupted."""
        cfg = self.config
        if cfg.node_rank == 0:
            return True
        return wait_for_master(
            cfg.master_addr, port, cfg.rdzv_timeout_s, self.sink.message,
            cancelled=lambda: self.stop_request.signum is not None,
        )  # fmt: skip

    def _announce_start(self, restart: int, port: int) -> None:
        cfg = self.config
        first, last = cfg.global_rank(0), cfg.global_rank(cfg.nproc_per_node - 1)
        self.sink.message(
            f"starting {cfg.nproc_per_node} worker{'s' if cfg.nproc_per_node > 1 else ''}: "
            f"ranks {first}..{last}"
            f" of {cfg.world_size}, master {cfg.master_addr}:{port}"
            + (f", restart {restart}" if restart else "")
        )

    def _after_failure(self, group: WorkerGroup, failure: Failure, restart: int) -> int | None:
        """Stop the rest, report the first failure; None when another attempt is allowed."""
        max_restarts = self.config.max_restarts
        self.sink.message(
            f"rank {failure.worker.rank} failed ({describe_returncode(failure.returncode)}); "
            "stopping the other workers"
        )
        group.stop(signal.SIGTERM, self.config.grace_s, self.stop_request)
        group.drain_output()
        self.sink.message(failure_summary(failure, self.config.node_rank))
        if restart < max_restarts and self.stop_request.signum is None:
            self.sink.message(
                f"restarting the worker group (restart {restart + 1} of {max_restarts})"
            )
            return None
        if max_restarts:
            self.sink.message(f"no restarts left (--max-restarts {max_restarts})")
        return failure.exit_code

    def _supervise(self, group: WorkerGroup) -> Failure | int:
        """Wait for a worker to fail (its Failure), all to succeed (0), or a signal (signum)."""
        while True:
            signum = self.stop_request.signum
            if signum is not None:
                return signum
            failure = group.first_failure()
            if failure is not None:
                return failure
            if group.all_succeeded():
                return 0
            time.sleep(self.config.monitor_interval_s)

    def _spawn(self, restart: int, port: int, extra: Mapping[str, str]) -> WorkerGroup:
        workers: list[Worker] = []
        argv = worker_argv(self.config, self.python)
        try:
            for local_rank in range(self.config.nproc_per_node):
                workers.append(self._spawn_one(argv, local_rank, restart, port, extra))
        except OSError as exc:
            WorkerGroup(workers).stop(signal.SIGKILL, 0.0, self.stop_request)
            raise ConfigurationError(
                f"cannot start {argv[0]!r}: {exc.strerror or exc} — check the command"
            ) from exc
        return WorkerGroup(workers)

    def _spawn_one(
        self,
        argv: list[str],
        local_rank: int,
        restart: int,
        port: int,
        extra: Mapping[str, str],
    ) -> Worker:
        cfg = self.config
        rank = cfg.global_rank(local_rank)
        env = worker_env(
            cfg,
            local_rank=local_rank,
            restart_count=restart,
            master_port=port,
            base=self.environ,
            extra=extra,
        )
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert process.stdout is not None and process.stderr is not None
        log_path = Path(cfg.log_dir) / f"rank_{rank}.log" if cfg.log_dir else None
        header = f"===== phalanx: restart {restart} =====" if restart else None
        output = RankOutput(rank, process.stdout, process.stderr, self.sink, log_path, header)
        return Worker(rank, local_rank, process, output)

    @contextmanager
    def _forward_signals(self) -> Iterator[None]:
        """Record SIGINT/SIGTERM instead of dying, so the workers are stopped first.

        Workers run in their own sessions, so a Ctrl-C typed at the terminal
        reaches only the launcher; it passes the signal on itself.
        """

        def record(signum: int, _frame: FrameType | None) -> None:
            self.stop_request.signums.append(signum)

        previous: dict[int, Any] = {}
        try:
            for forwarded in FORWARDED_SIGNALS:
                previous[forwarded] = signal.signal(forwarded, record)
        except ValueError:  # not the main thread: leave signals to whoever owns it
            pass
        try:
            yield
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)


def failure_summary(failure: Failure, node_rank: int) -> str:
    """Who failed first, how, and the end of its stderr (where the traceback is)."""
    worker = failure.worker
    lines = [
        f"FAILED: rank {worker.rank} (local rank {worker.local_rank} on node {node_rank}, "
        f"pid {worker.process.pid}) was the first to fail: "
        f"{describe_returncode(failure.returncode)}"
    ]
    tail = worker.output.stderr_tail()
    if tail:
        lines.append(f"the end of rank {worker.rank}'s stderr:")
        lines.extend(f"  | {line}" for line in tail)
    else:
        lines.append(f"rank {worker.rank} wrote nothing to stderr")
    return "\n".join(lines)
