"""Run the job on this node: meet the other nodes, spawn the workers, watch them, stop them
all when one fails, restart the group.

The agent talks to the workers only through their environment, their output,
their exit status, signals to their process groups, and the small progress
records they keep (`phalanx.ground.progress_record`). The job's store, when this
node hosts it, is served by `storehost`; a guard process (`lifeline`) stops the
workers if the agent itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import IO, Any

from phalanx.errors import TRACEBACK_FILE_ENV, ConfigurationError, ExitCode
from phalanx.ground.progress_record import PROGRESS_DIR_VAR, read_stop
from phalanx.ground.store_keys import (
    MEMBER_ENV,
)
from phalanx.launch.config import LaunchConfig
from phalanx.launch.exitwatch import fence_hung_exit
from phalanx.launch.forkstart import fresh_process, warm_start
from phalanx.launch.lifeline import LAUNCH_ID_ENV, Lifeline
from phalanx.launch.live import Connect, LiveSupervisor, take_members
from phalanx.launch.meeting import Meeting
from phalanx.launch.output import OutputSink
from phalanx.launch.procgroup import describe_returncode
from phalanx.launch.routing import ERR, OUT, LogLayout
from phalanx.launch.summary import failure_summary, find_stall
from phalanx.launch.workerenv import (
    gloo_ifname_env,
    live_env,
    server_env,
    worker_argv,
    worker_env,
)
from phalanx.launch.workers import (
    Failure,
    OutputPlan,
    Start,
    StopRequest,
    Worker,
    WorkerGroup,
    spawn_worker,
)

# A hang-up (a dropped ssh session) or SIGQUIT stops the workers as SIGTERM does: SIGTERM
# lets them save and exit, where SIGHUP's or SIGQUIT's default would kill or core-dump them.
_SENT_AS_SIGTERM = (signal.SIGHUP, signal.SIGQUIT)


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
        self._layout: LogLayout | None = None
        self._connect: Connect | None = None
        """New connections to the current attempt's store (live recovery's reports)."""
        self._start: Start = fresh_process
        """How a worker starts: fresh, or forked by the run's warm server."""

    def run(self) -> int:
        """Exit status of the job: 0, the failed worker's, or 128 + signum when stopped."""
        with self._handle_signals(), contextlib.ExitStack() as stack:
            for note in self.config.notes:
                self.sink.message(note)
            lifeline = Lifeline(self.config.grace_s, self.python)
            stack.callback(lifeline.close)
            meeting = Meeting(self.config, self.sink.message, self._cancelled)
            stack.callback(meeting.close)
            self.config = meeting.open()
            if self._cancelled():
                return self._stopped_by(self.stop_request.signum)
            extra = gloo_ifname_env(self.config, self.environ, self.sink.message)
            if self.config.start_method == "forkserver" and self.config.use_python:
                env = server_env(self.config, self.environ, extra)
                self._start = warm_start(self.python, env, self.sink.message, lifeline, stack)
            if self.config.routing.writes_files:
                self._layout = LogLayout(self.config.log_dir, self.config.run_id)
                self.sink.message(f"per-stream logs (-r/-t) in {self._layout.run_dir}")
            for restart in range(self.config.max_restarts + 1):
                if not meeting.begin_attempt(restart):
                    return self._stopped_by(self.stop_request.signum)
                status: int | None = None  # an exception: no exit barrier
                self._connect = meeting.connector(restart)
                own = {**extra, **meeting.worker_env(restart)}
                try:
                    status = self._attempt(restart, meeting.port, own, lifeline, meeting.late)
                finally:
                    meeting.end_attempt(last=status is not None, succeeded=status == 0)
                if status is not None:
                    return status
        raise AssertionError("unreachable: the last attempt always returns a status")

    def _cancelled(self) -> bool:
        return self.stop_request.signum is not None

    def _stopped_by(self, signum: int | None) -> int:
        signum = signum or signal.SIGINT
        self.sink.message(f"stopped by {signal.Signals(signum).name}")
        return 128 + signum

    def _attempt(
        self, restart: int, port: int, extra: Mapping[str, str], lifeline: Lifeline, late: bool
    ) -> int | None:
        """One run of the worker group; None means: failed, and a restart is allowed. A `late`
        node (it took a lost node's place, launch/livenodes.py) starts replacements."""
        assert self._connect is not None
        members = (
            take_members(self._connect, self.config.nproc_per_node, self.config.live_key())
            if late and restart == 0
            else []
        )
        self._announce_start(restart, port, members)
        progress_dir = Path(tempfile.mkdtemp(prefix="phalanx-progress-"))
        plan = self._output_plan(restart)
        extra = {**extra, PROGRESS_DIR_VAR: str(progress_dir), **live_env(self.config.live)}
        try:
            group = self._spawn(restart, port, extra, plan, lifeline, members)
            if self.config.live is not None:
                supervisor = self._live_supervisor(
                    group, restart, port, extra, plan, lifeline, progress_dir, members
                )
                status = supervisor.run()
                if supervisor.fell_back is not None:
                    return self._after_failure(group, supervisor.fell_back, restart, progress_dir)
                if supervisor.restart_asked is not None:
                    return self._restart_with_the_others(group, restart)
                signum = self.stop_request.signum
                group.stop(
                    _sent_signal(signum or signal.SIGTERM), self.config.grace_s, self.stop_request
                )
                group.drain_output()
                if signum is None and (summary := supervisor.summary()) is not None:
                    self.sink.message(summary)
                return status if signum is None else self._stopped_by(signum)
            outcome = self._supervise(group, progress_dir)
            if isinstance(outcome, Failure):
                return self._after_failure(group, outcome, restart, progress_dir)
            # After a success too: stray children of finished workers would outlive the job.
            group.stop(
                _sent_signal(outcome or signal.SIGTERM), self.config.grace_s, self.stop_request
            )
            group.drain_output()
            return 0 if outcome == 0 else self._stopped_by(outcome)
        finally:
            plan.close()
            shutil.rmtree(progress_dir, ignore_errors=True)

    def _output_plan(self, restart: int) -> OutputPlan:
        cfg = self.config
        attempt_dir = None
        filtered: dict[int, IO[bytes]] = {}
        if self._layout is not None:
            attempt_dir = self._layout.attempt_dir(restart, cfg.nproc_per_node)
            for stream, name in ((OUT, "stdout"), (ERR, "stderr")):
                if cfg.routing.duplicate_filters.get(stream):
                    filtered[stream] = (attempt_dir / f"filtered_{name}.log").open("wb")
        return OutputPlan(
            routing=cfg.routing,
            log_dir=Path(cfg.log_dir) if cfg.log_dir else None,
            attempt_dir=attempt_dir,
            header=f"===== phalanx: restart {restart} =====" if restart else None,
            filtered=filtered,
        )

    def _announce_start(self, restart: int, port: int, members: list[str]) -> None:
        cfg = self.config
        first, last = cfg.global_rank(0), cfg.global_rank(cfg.nproc_per_node - 1)
        ranks = f"rank {first}" if first == last else f"ranks {first}..{last}"
        joining = f" joining the run as replacement {', '.join(members)}" if members else ""
        store = (
            f"store etcd {','.join(cfg.rdzv.etcd)}"
            if cfg.rdzv.etcd
            else f"master {cfg.master_addr}:{port}"
        )
        self.sink.message(
            f"starting {cfg.nproc_per_node} worker{'s' if cfg.nproc_per_node > 1 else ''}: "
            f"{ranks} of {cfg.world_size}{joining}, {store}"
            + (f", restart {restart}" if restart else "")
        )

    def _after_failure(
        self, group: WorkerGroup, failure: Failure, restart: int, progress_dir: Path
    ) -> int | None:
        """Find a stalled rank, stop the rest, report; None when another attempt is allowed."""
        max_restarts = self.config.max_restarts
        worker = failure.worker
        stopped = read_stop(progress_dir, worker.rank)
        if stopped is not None:  # a clean preemption save, every rank at the same step
            self.sink.message(f"rank {worker.rank} stopped after saving; waiting for the others")
            group.await_exit(self.config.grace_s)
            group.stop(signal.SIGTERM, self.config.grace_s, self.stop_request)
            group.drain_output()
            self.sink.message(f"STOPPED: {stopped}")
        else:
            self.sink.message(
                f"rank {worker.rank} failed ({describe_returncode(failure.returncode)}); "
                "stopping the other workers"
            )
            stall = find_stall(worker.rank, group.workers, progress_dir)
            group.stop(signal.SIGTERM, self.config.grace_s, self.stop_request)
            group.drain_output()
            summary = failure_summary(worker, failure.returncode, self.config.node_rank, stall)
            self.sink.message(summary)
            if stall.uneven:  # the closed connection was the script's: a retry fails alike
                failure = Failure(worker, ExitCode.FAILED)
        if failure.exit_code == ExitCode.CONFIGURATION and restart < max_restarts:
            self.sink.message(  # the same configuration would fail the same way again
                f"rank {worker.rank} exited with a configuration error (exit code "
                f"{ExitCode.CONFIGURATION}): not restarting — fix the configuration"
            )
            return failure.exit_code
        return self._another_attempt(restart, failure.exit_code)

    def _restart_with_the_others(self, group: WorkerGroup, restart: int) -> int | None:
        """Another node's launcher restarts its worker group (launch/live.py): stop this
        node's and restart it too; None when another attempt is allowed."""
        group.stop(signal.SIGTERM, self.config.grace_s, self.stop_request)
        group.drain_output()
        return self._another_attempt(restart, int(ExitCode.FAILED))

    def _another_attempt(self, restart: int, exit_code: int) -> int | None:
        """None, said, when --max-restarts allows another attempt; else `exit_code`."""
        max_restarts = self.config.max_restarts
        if restart < max_restarts and not self._cancelled():
            self.sink.message(
                f"restarting the worker group (restart {restart + 1} of {max_restarts})"
            )
            return None
        if max_restarts:
            self.sink.message(f"no restarts left (--max-restarts {max_restarts})")
        return exit_code

    def _live_supervisor(
        self,
        group: WorkerGroup,
        restart: int,
        port: int,
        extra: Mapping[str, str],
        plan: OutputPlan,
        lifeline: Lifeline,
        progress_dir: Path,
        members: list[str],
    ) -> LiveSupervisor:
        """--live-recovery: replace lost workers, leave the others running (launch/live.py)."""
        assert self.config.live is not None and self._connect is not None

        def respawn(local_rank: int, member: str) -> Worker:
            return self._spawn_one(
                local_rank, restart, port, {**extra, MEMBER_ENV: member}, plan, lifeline
            )

        return LiveSupervisor(
            group=group,
            connect=self._connect,
            key=self.config.live_key(),
            progress_dir=progress_dir,
            respawn=respawn,
            replacements=self.config.max_restarts,
            stall_s=self.config.live.stall_s,
            say=self.sink.message,
            stop_request=self.stop_request,
            interval_s=self.config.monitor_interval_s,
            exit_timeout_s=self.config.exit_timeout_s,
            members=members,
            node_rank=self.config.node_rank if self.config.nnodes > 1 else None,
            nnodes=self.config.nnodes,
        )

    def _supervise(self, group: WorkerGroup, progress_dir: Path) -> Failure | int:
        """Wait for a worker to fail (its Failure), all to succeed (0), or a signal (signum).
        A worker hung in its exit is killed (launch/exitwatch.py), a failure like another."""
        killed: set[int] = set()
        while True:
            signum = self.stop_request.signum
            if signum is not None:
                return signum
            failure = group.first_failure()
            if failure is not None:
                return failure
            if group.all_succeeded():
                return 0
            for worker in group.workers:
                if worker.pid not in killed and worker.exit_status() is None:
                    who = f"rank {worker.rank}"
                    limit = self.config.exit_timeout_s
                    if fence_hung_exit(worker, who, progress_dir, limit, self.sink.message):
                        killed.add(worker.pid)
            group.wait(self.config.monitor_interval_s)

    def _spawn(
        self,
        restart: int,
        port: int,
        extra: Mapping[str, str],
        plan: OutputPlan,
        lifeline: Lifeline,
        members: list[str],
    ) -> WorkerGroup:
        """This node's workers: the first ones, or replacements named `members`."""
        workers: list[Worker] = []
        try:
            for local_rank in range(self.config.nproc_per_node):
                own = {**extra, MEMBER_ENV: members[local_rank]} if members else extra
                workers.append(self._spawn_one(local_rank, restart, port, own, plan, lifeline))
        except ConfigurationError:
            WorkerGroup(workers, lifeline).stop(signal.SIGKILL, 0.0, self.stop_request)
            raise
        return WorkerGroup(workers, lifeline)

    def _spawn_one(
        self,
        local_rank: int,
        restart: int,
        port: int,
        extra: Mapping[str, str],
        plan: OutputPlan,
        lifeline: Lifeline,
    ) -> Worker:
        cfg = self.config
        argv = worker_argv(cfg, self.python)
        env = worker_env(
            cfg,
            local_rank=local_rank,
            restart_count=restart,
            master_port=port,
            base=self.environ,
            extra=extra,
        )
        env[LAUNCH_ID_ENV] = lifeline.launch_id  # the guard's way to find it (lifeline.py)
        rank = cfg.global_rank(local_rank)
        if plan.log_dir is not None and TRACEBACK_FILE_ENV not in env:
            # The console shows a PhalanxError's one line; the log dir keeps it whole.
            env[TRACEBACK_FILE_ENV] = str(plan.log_dir / f"rank_{rank}.traceback")
        try:
            worker = spawn_worker(argv, env, rank, local_rank, self.sink, plan, self._start)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot start {argv[0]!r}: {exc.strerror or exc} — check the command"
            ) from exc
        # At once, not after the whole group: a SIGKILL now must not orphan it.
        lifeline.watch(worker.pid)
        return worker

    @contextlib.contextmanager
    def _handle_signals(self) -> Iterator[None]:
        """Record the handled signals instead of dying, so the workers are stopped first.

        Workers run in their own sessions, so a Ctrl-C typed at the terminal,
        or the hang-up of a dropped ssh session, reaches only the launcher; it
        passes the stop on itself.
        """

        def record(signum: int, _frame: FrameType | None) -> None:
            self.stop_request.signums.append(signum)

        previous: dict[int, Any] = {}
        try:
            for handled in self.config.handled_signals:
                previous[handled] = signal.signal(handled, record)
        except ValueError:  # not the main thread: leave signals to whoever owns it
            pass
        try:
            yield
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)


def _sent_signal(received: int) -> int:
    """The signal the workers get when the launcher received `received`."""
    return signal.SIGTERM if received in _SENT_AS_SIGTERM else received
