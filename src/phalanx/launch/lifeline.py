"""The lifeline: a tiny guard process that stops the workers when the launcher dies unseen.

The launcher stops its workers itself on every signal it can catch, but nothing
runs in a process killed by SIGKILL (the OOM killer, `kill -9`, a scheduler).
Its workers, each in its own session, would then train on unsupervised and keep
writing checkpoints. So the launcher starts this guard in a session of its own
and tells it, through a pipe, which process groups it spawned (`+PGID`) and
which it has stopped (`-PGID`, so a recycled id is never signalled). When the
launcher exits, the pipe closes: after a clean `exit` line the guard just
leaves; without one the launcher died, and the guard sends SIGTERM to every
group still listed, SIGKILL half a second later, and reports it.

That half second is the guard's own, not `--shutdown-timeout`: the grace period
is for a stop the launcher supervises (a preemption, Ctrl-C), in which a worker
may save. A launcher killed outright leaves nobody to wait for that save or to
report it, and whatever sent SIGKILL wanted the job gone, so the workers go
within a second of it (docs/reliability.md has the soak). A save cut off there
is left as a `.tmp` directory, which is never loaded.

A worker spawned in the instant before its `+PGID` line was written would
escape that list, so every worker also carries this launch's id in its
environment (`PHALANX_LAUNCH_ID`), and the guard stops every process that
carries it too: it keeps looking for them for a moment, since one may still be
between fork and exec when the launcher dies. The id also reaches what a
worker starts outside its process group.

A pipe works wherever the launcher dies and however; a parent-death signal
would need code in every worker (or a `preexec_fn`, unsafe in the launcher's
threads) and would reach only the worker, not what it forked.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from phalanx.launch.procgroup import signal_group, signal_processes, tagged_processes

__all__ = ["LAUNCH_ID_ENV", "Lifeline"]

LAUNCH_ID_ENV = "PHALANX_LAUNCH_ID"
_POLL_S = 0.05
# How long after the launcher's death the guard keeps looking for tagged processes
# that were still starting (between fork and exec, microseconds on an idle host)
# when it died.
_LATE_START_S = 0.5
# The most a worker gets between SIGTERM and SIGKILL once the launcher is dead: with
# _LATE_START_S it keeps the whole job's end within the second docs/launch.md promises.
_ORPHAN_GRACE_S = 0.5
# The package's parent directory: the guard imports this module from it with `-S`
# (no site-packages scan), which keeps its start-up to a few milliseconds.
_IMPORT_ROOT = str(Path(__file__).resolve().parents[2])


class Lifeline:
    """The launcher's end of the pipe to its guard process."""

    def __init__(self, grace_s: float, python: str = sys.executable) -> None:
        self.launch_id = secrets.token_hex(8)  # goes into each worker's environment
        read_end, write_end = os.pipe()
        code = (
            f"import sys; sys.path.insert(0, {_IMPORT_ROOT!r}); "
            "from phalanx.launch.lifeline import guard; guard()"
        )
        try:
            self._guard = subprocess.Popen(
                [python, "-I", "-S", "-c", code, str(grace_s), self.launch_id],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_end)
        self._pipe: IO[bytes] | None = os.fdopen(write_end, "wb", buffering=0)
        self._lock = threading.Lock()  # watch and release may come from several threads

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pipe is None:
                return
            try:
                self._pipe.write(f"{line}\n".encode())
            except OSError:  # the guard is gone; nothing more it can do for us
                self._pipe = None

    def watch(self, pgid: int) -> None:
        """Stop group `pgid` if the launcher dies before `release(pgid)`."""
        self._send(f"+{pgid}")

    def release(self, pgid: int) -> None:
        """Group `pgid` is stopped and gone: forget it."""
        self._send(f"-{pgid}")

    def close(self) -> None:
        """The launcher is leaving cleanly: let the guard go without touching anything."""
        self._send("exit")
        with self._lock:
            if self._pipe is not None:
                self._pipe.close()
                self._pipe = None
        try:
            self._guard.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._guard.kill()
            self._guard.wait()


def _stop_all(pgids: set[int], launch_id: str, grace_s: float) -> None:
    """SIGTERM the groups and every tagged process, SIGKILL them after `grace_s` (at
    most _ORPHAN_GRACE_S), and keep doing so to late starters for _LATE_START_S."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    kill_at = min(grace_s, _ORPHAN_GRACE_S)
    start = time.monotonic()
    tagged: set[int] = set()
    while (elapsed := time.monotonic() - start) < _LATE_START_S:
        found = tagged_processes(LAUNCH_ID_ENV, launch_id)
        signal_processes(found - tagged, signal.SIGTERM)
        tagged |= found
        if elapsed >= kill_at:
            _kill_all(pgids, found)
        time.sleep(_POLL_S)
    _kill_all(pgids, tagged_processes(LAUNCH_ID_ENV, launch_id))


def _kill_all(pgids: set[int], pids: set[int]) -> None:
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    signal_processes(pids, signal.SIGKILL)


def guard() -> None:
    """The guard process: read the launcher's lines until the pipe closes (see the module)."""
    grace_s, launch_id = float(sys.argv[1]), sys.argv[2]
    pgids: set[int] = set()
    for raw in sys.stdin.buffer:
        line = raw.decode().strip()
        if line == "exit":
            return
        if line[:1] in "+-" and line[1:].isdigit():
            (pgids.add if line[0] == "+" else pgids.discard)(int(line[1:]))
    if pgids or tagged_processes(LAUNCH_ID_ENV, launch_id):
        with contextlib.suppress(OSError):  # the launcher's terminal may have gone with it
            print(
                "[phalanx] the launcher died without stopping its workers; stopping them",
                file=sys.stderr,
                flush=True,
            )
    _stop_all(pgids, launch_id, grace_s)
