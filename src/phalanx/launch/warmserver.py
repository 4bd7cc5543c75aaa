"""The warm server behind `--start-method forkserver`: an interpreter that imports torch
once and forks every worker from there, so that a worker starts without paying for the
import. That matters most for a live-recovery replacement, which would otherwise import
on the cores the survivors are training on (docs/reliability.md).

It runs as `python -u -m phalanx.launch.warmserver FD`, a process of its own: the
launcher itself still imports no torch (launch/__init__.py). It is each worker's
interpreter before that interpreter becomes the worker, so what it imports is named
here as data (WARM_MODULES), never imported by the launcher. FD is its end of a
SOCK_SEQPACKET pair with the launcher (launch/forkstart.py):

- it says first whether it is safe to fork from: {"ready": true}, or {"ready": false,
  "why": ...} when importing loaded the CUDA driver, which a forked child cannot use;
- each request is {"argv", "env", "cwd"} with the worker's stdout and stderr descriptors
  attached; it forks, answers {"pid"}, and the child becomes the worker: its own
  session, those descriptors, that environment and directory, and the command run as
  `python -u` would run it (a script, `-m module` or `-c code`);
- when a worker exits it says {"exited": pid, "returncode": ...} (Popen's convention:
  minus the signal that killed it);
- when the launcher's end closes it exits; its workers are the launcher's to stop.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import types
from pathlib import Path
from typing import Any

WARM_MODULES = ("torch", "torch.distributed", "phalanx.train")
"""What every phalanx worker imports before its first step (1.4 s of CPU on this
project's 2-core machine)."""
MAX_MESSAGE = 1 << 20
_CUDA_DRIVER = "libcuda.so"


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    why = _warm()
    _send(sock, {"ready": why is None} | ({} if why is None else {"why": why}))
    if why is not None:
        return 0
    children: dict[int, int] = {}  # pidfd -> pid
    watch = select.poll()
    watch.register(sock.fileno(), select.POLLIN)
    while True:
        for fd, _ in watch.poll():
            if fd != sock.fileno():
                pid = children.pop(fd)
                watch.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data:  # the launcher closed its end, or died: nothing to finish
                os._exit(0)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _close_all(sock, children)
                _become_worker(request, fds)  # raises SystemExit with the worker's status
            for passed in fds:
                os.close(passed)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            watch.register(pidfd, select.POLLIN)
            _send(sock, {"pid": pid})


def _warm() -> str | None:
    """Import WARM_MODULES; None, or why forking from here is unsafe. A module that fails to
    import is left to the worker, whose own import says what is wrong."""
    for name in WARM_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    maps = Path("/proc/self/maps")
    if maps.exists() and _CUDA_DRIVER in maps.read_text():
        return f"importing {', '.join(WARM_MODULES)} loaded the CUDA driver"
    return None


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
        sock.send(json.dumps(message).encode())


def _close_all(sock: socket.socket, children: dict[int, int]) -> None:
    """In a new child: let go of what is the server's, so the launcher sees EOF when the
    server ends, whatever its workers do."""
    sock.close()
    for pidfd in children:
        os.close(pidfd)


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    """Turn this forked child into the worker `request` describes, run it, and leave
    through SystemExit as `python -u` would have exited."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, source in ((0, devnull), (1, fds[0]), (2, fds[1])):
        os.dup2(source, target)
    for source in (devnull, *fds):
        os.close(source)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_random_state()
    try:
        _run(request["argv"])
    except SystemExit:
        raise
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as python dies of an uncaught Ctrl-C
        raise SystemExit(130) from None
    except BaseException as exc:  # printed as python prints it, then exit 1
        trimmed = exc.with_traceback(_user_frames(exc.__traceback__))
        sys.excepthook(type(exc), trimmed, trimmed.__traceback__)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _fresh_random_state() -> None:
    """What a fresh interpreter would start with: each its own random seeds. `random`
    reseeds itself after a fork; torch's CPU generator (seeded from the OS at import) and
    numpy's global one, where imported, are seeded anew from the OS here."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _run(argv: list[str]) -> None:
    """`python -u ARGV`: ARGV is `script args`, `-m module args` or `-c code args`."""
    args = argv[1:] if argv[:1] == ["-u"] else argv
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(args[1], "<string>", "exec"), main_module.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the worker's own code on: without this module's and runpy's
    frames, as a fresh interpreter would print it."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def can_run(argv_after_python: list[str]) -> bool:
    """Whether the server runs this command line as python would: `-u` then a script,
    `-m module` or `-c code` (no other interpreter options)."""
    args = argv_after_python
    if args[:1] != ["-u"] or len(args) < 2:
        return False
    if args[1] in ("-m", "-c"):
        return len(args) >= 3
    return not args[1].startswith("-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
