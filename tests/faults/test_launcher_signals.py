"""The launcher dies, the workers do not live on (issue 12, item 1).

Workers run in sessions of their own, so nothing but the launcher stops them.
SIGHUP (a dropped ssh session) and SIGQUIT are handled like SIGTERM; SIGKILL
cannot be handled at all, and the lifeline guard stops the workers instead.
Each trial starts a launcher whose workers sleep with a grandchild each, hits
it with the signal, and then looks through /proc for any process that carries
the trial's mark in its environment: there must be none. (torchrun, SIGKILLed
the same way, leaves all four processes running: docs/reliability.md.)
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from phalanx.launch.lifeline import LAUNCH_ID_ENV, Lifeline
from tests.launchkit import (
    LAUNCH,
    SCRIPTS,
    clean_env,
    finish,
    is_running,
    marked_processes,
    pids_of,
    start,
    wait_for,
    wait_until_gone,
)

pytestmark = pytest.mark.faults

# SIGTERM to the workers, up to the default 5 s grace, SIGKILL: gone well within this.
GONE_WITHIN_S = 10.0
# What docs/launch.md promises once the launcher is SIGKILLed: the workers, what they
# started and the guard itself, all gone within a second, however long a worker's
# SIGTERM handler would take.
ORPHANS_GONE_WITHIN_S = 1.0


def _start_sleepers(out: Path, mark: str, method: str = "spawn") -> subprocess.Popen[str]:
    """A launcher of 2 workers that each sleep 60 s with a grandchild (fail_fast.py, whose
    failing rank 99 does not exist); `forkserver`: forked from a warm server, which is
    marked as they are."""
    argv = [*LAUNCH, "--nproc-per-node", "2", "--start-method", method,
            SCRIPTS / "fail_fast.py", out, 99, "exit"]  # fmt: skip
    return start(argv, env=clean_env(PHALANX_TEST_MARK=mark))


def _kill_leftovers(mark: str) -> None:
    """A failed trial must not leave its sleepers to the next test."""
    for pid in marked_processes(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _expected_status(signum: int) -> int:
    return -signal.SIGKILL if signum == signal.SIGKILL else 128 + signum


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("signum", "method"),
    [
        (signal.SIGHUP, "spawn"),
        (signal.SIGQUIT, "spawn"),
        (signal.SIGKILL, "spawn"),
        (signal.SIGKILL, "forkserver"),
    ],
)
def test_no_worker_outlives_the_launcher(
    tmp_path: Path, signum: signal.Signals, method: str
) -> None:
    mark = uuid.uuid4().hex
    launcher = _start_sleepers(tmp_path, mark, method)
    try:
        wait_for([tmp_path / f"pids_{r}" for r in range(2)])
        workers = pids_of(tmp_path, range(2))  # each worker and its grandchild
        launcher.send_signal(signum)
        _, err = finish(launcher)
        assert launcher.returncode == _expected_status(signum), err
        assert wait_until_gone(workers, GONE_WITHIN_S) == []
        assert wait_until_gone(marked_processes(mark), GONE_WITHIN_S) == []
    finally:
        _kill_leftovers(mark)
    if signum == signal.SIGKILL:
        assert "the launcher died without stopping its workers" in err
    else:
        assert f"stopped by {signum.name}" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_hangup_and_quit_reach_the_workers_as_sigterm(
    tmp_path: Path, signum: signal.Signals
) -> None:
    launcher = start([*LAUNCH, "--nproc-per-node", "2", SCRIPTS / "trap_signals.py", tmp_path])
    wait_for([tmp_path / f"ready_{r}" for r in range(2)])
    launcher.send_signal(signum)
    finish(launcher)
    assert launcher.returncode == 128 + signum
    # SIGTERM lets a worker save and leave; SIGHUP's default would kill it, SIGQUIT's dump core.
    assert [(tmp_path / f"got_{r}").read_text() for r in range(2)] == ["SIGTERM"] * 2


def _sigkill_slow_stoppers(tmp_path: Path) -> tuple[float, list[int], str]:
    """SIGKILL a launcher whose 2 workers take 30 s over SIGTERM and whose grandchildren
    ignore it: (seconds until nothing of the job ran, or the deadline; what still ran
    at the deadline; the launcher's stderr)."""
    mark = uuid.uuid4().hex
    out = tmp_path / mark
    out.mkdir()
    argv = [*LAUNCH, "--nproc-per-node", "2", SCRIPTS / "slow_to_stop.py", out]
    launcher = start(argv, env=clean_env(PHALANX_TEST_MARK=mark))
    try:
        wait_for([out / f"pids_{r}" for r in range(2)])
        job = set(pids_of(out, range(2))) | set(marked_processes(mark)) - {launcher.pid}
        killed_at = time.monotonic()
        launcher.send_signal(signal.SIGKILL)
        deadline = killed_at + ORPHANS_GONE_WITHIN_S
        # The job's processes, and any that carry its mark and started late, polled.
        while job and time.monotonic() < deadline:
            time.sleep(0.01)
            job = {pid for pid in job if is_running(pid)} | set(marked_processes(mark))
        took = time.monotonic() - killed_at
        _, err = finish(launcher)
    finally:
        _kill_leftovers(mark)
    return took, sorted(job), err


@pytest.mark.timeout(60)
def test_sigkilled_launchers_workers_are_gone_within_a_second(tmp_path: Path) -> None:
    """Two trials of the soak below: workers slow to stop on SIGTERM (a save in flight)
    were left the whole --shutdown-timeout (5 s) before; the launcher's death is not a
    stop anyone supervises, so they get half a second."""
    for _ in range(2):
        took, left, err = _sigkill_slow_stoppers(tmp_path)
        assert left == [], f"still running {took:.2f} s after the launcher's SIGKILL: {left}"
        assert "the launcher died without stopping its workers" in err


def _one_random_trial(tmp_path: Path, signum: int, rng: random.Random) -> tuple[bool, list[int]]:
    """Signal the launcher at a random moment of its first 1.5 s (store, spawn, run):
    (did it exit with the right status, what was left running)."""
    mark = uuid.uuid4().hex
    out = tmp_path / mark
    out.mkdir()
    launcher = _start_sleepers(out, mark)
    time.sleep(rng.uniform(0.0, 1.5))
    launcher.send_signal(signum)
    finish(launcher)
    left = wait_until_gone(marked_processes(mark), GONE_WITHIN_S)
    _kill_leftovers(mark)
    # Before its handlers are in place (the first milliseconds), the signal's default
    # action ends the launcher, which has spawned nothing yet.
    status_ok = launcher.returncode in (_expected_status(signum), -signum)
    return status_ok, left


def _tagged_sleeper(launch_id: str) -> subprocess.Popen[bytes]:
    """A worker as the launcher spawns it (own session, tagged) that the guard was never told of."""
    env = clean_env(**{LAUNCH_ID_ENV: launch_id})
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)


@pytest.mark.timeout(30)
def test_guard_stops_workers_it_was_never_told_of() -> None:
    """The launcher SIGKILLed between spawning a worker and writing its `+PGID` line (the
    one race the soak below once hit), and a worker still starting when it died: both
    are found by the launch id in their environment and stopped."""
    lifeline = Lifeline(grace_s=1.0)
    unlisted = _tagged_sleeper(lifeline.launch_id)
    listed = _tagged_sleeper(lifeline.launch_id)
    lifeline.watch(listed.pid)
    other = _tagged_sleeper("another-launch")
    procs = [unlisted, listed, other]
    try:
        assert lifeline._pipe is not None
        lifeline._pipe.close()  # the launcher's death as the guard sees it: no `exit` line
        lifeline._pipe = None
        listed.wait(timeout=10)  # the guard is sweeping (an event, not a pause)
        procs.append(late := _tagged_sleeper(lifeline.launch_id))  # was between fork and exec
        for proc in (unlisted, listed, late):
            proc.wait(timeout=10)
        assert lifeline._guard.wait(timeout=10) == 0
        assert other.poll() is None  # another launch's worker is not ours to stop
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signal_soak(tmp_path: Path) -> None:
    """20 trials per signal at random moments; every launcher exits, nothing survives."""
    rng = random.Random(12)
    trials, failures = 20, []
    for signum in (signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL, signal.SIGTERM):
        for trial in range(trials):
            status_ok, left = _one_random_trial(tmp_path, signum, rng)
            if not status_ok or left:
                failures.append((signal.Signals(signum).name, trial, status_ok, left))
    print(f"signal soak: {4 * trials} trials, {4 * trials - len(failures)} clean")
    assert failures == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_soak_workers_gone_within_a_second(tmp_path: Path) -> None:
    """40 launcher SIGKILLs; in every one the workers, their grandchildren and the guard
    are gone within ORPHANS_GONE_WITHIN_S (docs/reliability.md has the count)."""
    trials, times, failures = 40, [], []
    for trial in range(trials):
        took, left, err = _sigkill_slow_stoppers(tmp_path)
        times.append(took)
        if left or "the launcher died without stopping its workers" not in err:
            failures.append((trial, round(took, 3), left))
    print(f"sigkill soak: {trials} trials, {trials - len(failures)} gone within "
          f"{ORPHANS_GONE_WITHIN_S} s; slowest {max(times):.3f} s")  # fmt: skip
    assert failures == []
