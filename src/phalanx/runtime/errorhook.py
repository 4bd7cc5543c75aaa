"""An uncaught PhalanxError ends a script with its one line, not a traceback.

phalanx's errors already say what is wrong and what to do; a 50-line
traceback on every rank buries that line. `phalanx.init()` installs this
hook: an uncaught `PhalanxError` prints `ConfigurationError: <message>` on
stderr (under a launcher, prefixed with the rank) and exits 1, as before.
`PHALANX_TRACEBACK=1` prints the whole traceback instead; and when
`PHALANX_TRACEBACK_FILE` names a file (`phalanx launch --log-dir` sets one per
rank, beside its log) the whole traceback is written there too. Any other
exception goes to the hook that was there before.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from phalanx.errors import TRACEBACK_ENV, TRACEBACK_FILE_ENV, PhalanxError


def install_error_hook() -> None:
    """Make `sys.excepthook` print an uncaught PhalanxError as its one line (once)."""
    if getattr(sys.excepthook, "_phalanx", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(error, PhalanxError) or os.environ.get(TRACEBACK_ENV, "") not in (
            "",
            "0",
        ):
            previous(kind, error, tb)
            return
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

    hook._phalanx = True  # type: ignore[attr-defined]
    sys.excepthook = hook
