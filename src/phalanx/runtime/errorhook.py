"""An uncaught PhalanxError ends a script with its one line, not a traceback, and every
uncaught error with the exit status docs/clusters.md promises a scheduler.

phalanx's errors already say what is wrong and what to do; a 50-line
traceback on every rank buries that line. `phalanx.init()` installs this
hook: an uncaught `PhalanxError` prints `ConfigurationError: <message>` on
stderr (under a launcher, prefixed with the rank) and exits with its class's
`exit_code` (2 for a configuration error, 203 for a failed peer or network,
1 otherwise). `PHALANX_TRACEBACK=1` prints the whole traceback instead; and
when `PHALANX_TRACEBACK_FILE` names a file (`phalanx launch --log-dir` sets one
per rank, beside its log) the whole traceback is written there too.

Any other exception goes to the hook that was there before; one that says a
peer or the store went away (torch.distributed's DistError family, gloo's
transport errors) then exits 203 instead of Python's 1, since under Kubeflow's
`restartPolicy: ExitCode` a 1 on the survivors of a lost node fails the whole
job where a restart would resume it. A SystemExit raised by a hook is how
CPython lets it choose the status (pythonrun.c: the hook's SystemExit is handled
as the process's own): the interpreter then exits normally, atexit included.
torch's `init_process_group` wraps whatever hook is there: while it runs, `sys.stderr`
is a StringIO that torch copies out (each line tagged `[rank<N>]: `) only when the hook
returns; a hook that raises SystemExit skips that copy, so before raising it this one
writes out what it put there itself (`_flush_torch_buffer`).
"""

from __future__ import annotations

import io
import os
import sys
import traceback
from types import TracebackType

from phalanx.errors import TRACEBACK_ENV, TRACEBACK_FILE_ENV, ExitCode, PhalanxError

# What gloo's errors say when a peer is gone or silent: its transport raises plain
# RuntimeErrors ("[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by
# peer", "Timed out waiting 1800000ms for recv operation to complete").
_PEER_FAILURES = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
)


def exit_code_of(error: BaseException) -> int:
    """The status an uncaught `error` ends the process with (docs/clusters.md)."""
    if isinstance(error, PhalanxError):
        return int(error.exit_code)
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    if isinstance(dist_error, type) and isinstance(error, dist_error):
        return ExitCode.INFRASTRUCTURE  # DistBackendError, DistNetworkError, DistStoreError
    if isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_FAILURES):
        return ExitCode.INFRASTRUCTURE
    return ExitCode.FAILED


def install_error_hook() -> None:
    """Make `sys.excepthook` print an uncaught PhalanxError as its one line (once)."""
    if getattr(sys.excepthook, "_phalanx", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        code = exit_code_of(error)
        if not isinstance(error, PhalanxError) or os.environ.get(TRACEBACK_ENV, "") not in (
            "",
            "0",
        ):
            previous(kind, error, tb)
        else:
            _one_line(kind, error, tb)
        if code != ExitCode.FAILED:
            _flush_torch_buffer()
            raise SystemExit(code)

    hook._phalanx = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _flush_torch_buffer() -> None:
    """Under torch's wrapping hook (module docstring), write what this hook printed to the
    real stderr now: the SystemExit that follows skips torch's own copy of it."""
    stream, real = sys.stderr, sys.__stderr__
    if not isinstance(stream, io.StringIO) or real is None or stream is real:
        return
    text = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    real.write(text)
    real.flush()


def _one_line(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    where = os.environ.get(TRACEBACK_FILE_ENV)
    if where:
        try:
            with open(where, "a", encoding="utf-8") as file:
                file.write("".join(traceback.format_exception(kind, error, tb)))
        except OSError:
            where = None
    line = " ".join(str(error).split())  # one line, whatever the message held
    note = f" (traceback: {where})" if where else f" (set {TRACEBACK_ENV}=1 for the traceback)"
    sys.stderr.write(f"{kind.__name__}: {line}{note}\n")
    sys.stderr.flush()
