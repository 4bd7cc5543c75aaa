"""Why a checkpoint write failed, in the system's words: the reason each save's one line gives.

torch.save and DCP report a failed write as "unexpected pos" (or gather it into
DCP's CheckpointException); probing the same directory with a small synced
write brings the system's reason back ("no space left on device").
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from phalanx.ground.safe_files import create_file
from phalanx.train.checkpoint.directory import describe_os_error

_PROBE_BYTES = 1 << 20


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def reason(exc: BaseException, tmp: Path) -> tuple[str, bool]:
    """Why a write failed, in the system's words where they can be found; and whether the
    file system (not the state) is to blame."""
    if isinstance(exc, OSError):
        return describe_os_error(exc), True
    if isinstance(exc, dcp_errors()):
        failures: dict[int, Any] = exc.failures  # type: ignore[attr-defined]
        ranks = sorted(failures)
        probed = probe(tmp)
        cause = probed or first_line(failures[ranks[0]][0])
        return f"rank(s) {ranks} could not write their shards ({cause})", probed is not None
    probed = probe(tmp) if "unexpected pos" in str(exc) else None
    if probed is not None:
        return probed, True
    return f"{type(exc).__name__}: {first_line(exc)}", False


def probe(directory: Path) -> str | None:
    """Write and sync a small file in `directory`: the reason it fails, or None."""
    made: Path | None = None
    try:
        made, file = create_file(directory, ".phalanx-probe")
        with file:
            file.write(bytes(_PROBE_BYTES))
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        return describe_os_error(OSError(exc.errno, exc.strerror), directory)
    finally:
        if made is not None:
            with contextlib.suppress(OSError):
                made.unlink()
    return None


def dcp_errors() -> tuple[type[BaseException], ...]:
    """DCP's CheckpointException, once torch.distributed.checkpoint is loaded (only
    sharded state loads it, lazily: seconds of import); before, none can be raised."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()


def failures() -> tuple[type[BaseException], ...]:
    """What a save or load step may raise that becomes a CheckpointError."""
    return (Exception, *dcp_errors())
