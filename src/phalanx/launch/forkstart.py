"""`--start-method forkserver`, the launcher's side: one warm server per launcher
(launch/warmserver.py) forks the workers, and a `ForkedProcess` stands in for each
worker's Popen.

The server is the workers' parent, so their exit statuses come from it, over the same
socket the requests go down. Where it cannot serve (it found the CUDA driver loaded,
it died, the command is not one it runs) the worker starts as a fresh interpreter
instead, said once.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.launch.lifeline import LAUNCH_ID_ENV, Lifeline
from phalanx.launch.warmserver import MAX_MESSAGE, can_run

__all__ = ["ForkServer", "ForkedProcess", "fresh_process", "warm_start"]

_READY_TIMEOUT_S = 300.0
"""The most the first worker waits for the server's imports (seconds on a loaded host)."""
_EXIT_REPORT_S = 5.0
"""How long a status may lag the exit its pidfd shows: the server reports at once."""
_CLOSE_S = 5.0
_LOST = -signal.SIGKILL
"""The status of a worker whose server died before saying how it ended."""


class ForkServer:
    """The warm server this launcher forks its workers from; owned by the agent's run."""

    def __init__(self, python: str, env: dict[str, str], say: Callable[[str], None]) -> None:
        self._say = say
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [python, "-u", "-m", "phalanx.launch.warmserver", str(theirs.fileno())],
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._python = python
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self._gone = False
        self._statuses: dict[int, int] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(
        self, argv: list[str], env: dict[str, str], stdout: int, stderr: int
    ) -> ForkedProcess | subprocess.Popen[bytes]:
        """The worker `argv` with `env`, its output on `stdout` and `stderr`: forked from
        the server, or started fresh where the server cannot run it."""
        if argv[0] == self._python and can_run(argv[1:]):
            request = {"argv": argv[1:], "env": env, "cwd": os.getcwd()}
            pid = self._fork(json.dumps(request).encode(), [stdout, stderr])
            if pid is not None:
                return ForkedProcess(self, pid)
        return fresh_process(argv, env, stdout, stderr)

    def _fork(self, request: bytes, fds: list[int]) -> int | None:
        with self._lock:
            if not self._await_ready():
                return None
            try:
                socket.send_fds(self._sock, [request], fds)
            except OSError as exc:  # a request too large (EMSGSIZE), or the server gone
                self._say(f"the warm server cannot take this worker ({exc}): started fresh")
                return None
            while not self._gone:
                message = self._receive(None)
                if message is not None and "pid" in message:
                    return int(message["pid"])
            return None

    def _await_ready(self) -> bool:
        while self._ready is None and not self._gone:
            message = self._receive(_READY_TIMEOUT_S)
            if message is None and not self._gone:
                self._gone = True  # no word in minutes: treat it as lost
            elif message is not None and "ready" in message:
                self._ready = bool(message["ready"])
                if not self._ready:
                    self._say(f"{message.get('why')}: workers start fresh (spawn)")
        if self._gone and self._ready is None:
            self._say("the warm server ended before it was ready: workers start fresh (spawn)")
            self._ready = False
        return bool(self._ready) and not self._gone

    def _receive(self, timeout_s: float | None) -> dict[str, Any] | None:
        """One message (exit reports are filed as they pass), or None after `timeout_s`."""
        if self._sock.fileno() < 0:  # closed: the run is over
            self._gone = True
            return None
        if not _readable(self._sock.fileno(), timeout_s):
            return None
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            if self._ready:
                self._say(
                    f"the warm server (pid {self.pid}) died: how the workers it forked end is "
                    "lost, and each counts as killed when it exits"
                )
            self._gone = True
            return None
        message: dict[str, Any] = json.loads(data)
        if "exited" in message:
            self._statuses[int(message["exited"])] = int(message["returncode"])
        return message

    @property
    def gone(self) -> bool:
        """The server died (or was closed): the statuses it did not send are lost."""
        return self._gone

    def status(self, pid: int, wait_s: float) -> int | None:
        """`pid`'s returncode once the server has said it, waiting up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while pid not in self._statuses and not self._gone:
                left = deadline - time.monotonic()
                if self._receive(max(0.0, left)) is None and left <= 0:
                    break
            return self._statuses.pop(pid, None)

    def close(self) -> None:
        """Close the server's socket; it exits on that, and is killed if it does not."""
        self._ready = False  # its end is no news
        self._sock.close()
        try:
            self.process.wait(_CLOSE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """A worker forked by the server, with the part of Popen's interface the launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            ended = self._ended()
            self._settle(self._server.status(self.pid, _EXIT_REPORT_S if ended else 0.0))
            if self.returncode is None and ended and self._server.gone:
                self._settle(_LOST)  # its parent died before it could say how it ended
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            step = 1.0 if left is None else min(left, 1.0)
            if self._server.gone:
                self._ended(step)
            else:
                self._settle(self._server.status(self.pid, step))
        assert self.returncode is not None
        return self.returncode

    def _ended(self, wait_s: float = 0.0) -> bool:
        """Whether the process has exited (its pidfd is readable), waiting up to `wait_s`."""
        if self._pidfd is None:
            time.sleep(wait_s)
            return False
        return _readable(self._pidfd, wait_s)

    def _settle(self, returncode: int | None) -> None:
        if returncode is not None and self.returncode is None:
            self.returncode = returncode
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None


def warm_start(
    python: str,
    env: dict[str, str],
    say: Callable[[str], None],
    lifeline: Lifeline,
    stack: contextlib.ExitStack,
) -> Callable[[list[str], dict[str, str], int, int], ForkedProcess | subprocess.Popen[bytes]]:
    """A run's warm server, on the lifeline's watch and closed with `stack`: how its workers
    start (`ForkServer.start`). `env` is the server's (workerenv.server_env), tagged here
    with the launch's id as every worker is, so the guard finds it too."""
    server = ForkServer(python, {**env, LAUNCH_ID_ENV: lifeline.launch_id}, say)
    lifeline.watch(server.pid)

    def close() -> None:
        server.close()
        lifeline.release(server.pid)

    stack.callback(close)
    return server.start


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether `fd` is readable within `timeout_s` (None: no limit). poll, not select: no
    limit on the descriptor's number."""
    watch = select.poll()
    watch.register(fd, select.POLLIN)
    return bool(watch.poll(None if timeout_s is None else timeout_s * 1000))


def fresh_process(
    argv: list[str], env: dict[str, str], stdout: int, stderr: int
) -> subprocess.Popen[bytes]:
    """A worker as a fresh interpreter (`--start-method spawn`), in a session of its own."""
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
