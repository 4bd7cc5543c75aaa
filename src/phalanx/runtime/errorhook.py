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
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

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
    """Print an uncaught PhalanxError as its one line, and end with its exit status.

    Two hooks: the printer sits where it is installed, so a hook installed later
    (torch's `init_process_group` prefixes each line with `[rank<N>]: `) wraps its
    output; the exit status is raised by an outer hook, put back on top at each call
    (`phalanx.init` calls again once the group exists), since a SystemExit raised
    inside torch's wrapper would lose the text that wrapper holds back to prefix.
    """
    if getattr(sys.excepthook, "_phalanx_exit", False):
        return
    inner = sys.excepthook
    if not _has_printer(inner):
        inner = _printer(inner)

    def exit_with_status(
        kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        inner(kind, error, tb)
        code = exit_code_of(error)
        # A hook installed over this one runs around it: the status is its to raise.
        if code != ExitCode.FAILED and sys.excepthook is exit_with_status:
            raise SystemExit(code)

    exit_with_status._phalanx_exit = True  # type: ignore[attr-defined]
    exit_with_status._phalanx_printer = True  # type: ignore[attr-defined]
    sys.excepthook = exit_with_status


def _has_printer(hook: object) -> bool:
    """Whether `hook` is one of ours, or a wrapper (torch's) whose chain holds one."""
    seen = 0
    while hook is not None and seen < 8:
        if getattr(hook, "_phalanx_printer", False):
            return True
        cells = getattr(hook, "__closure__", None) or ()
        hook = next(
            (c.cell_contents for c in cells if callable(getattr(c, "cell_contents", None))),
            None,
        )
        seen += 1
    return False


Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def _printer(previous: Hook) -> Hook:
    def print_error(
        kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        if isinstance(error, PhalanxError) and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):
            _one_line(kind, error, tb)
        else:
            previous(kind, error, tb)

    print_error._phalanx_printer = True  # type: ignore[attr-defined]
    return print_error


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
