"""Whose offload scratch directory this is, and the sweep of those whose owner is gone.

A directory's name carries its owner's pid together with what makes that pid
mean one process (`owner_key`): the host, the boot, and the PID namespace. A
sweep judges only the directories of its own key (files.py's module docstring
says why).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

__all__ = ["PREFIX", "owner_key", "sweep_dead_runs"]

PREFIX = "phalanx-offload"
# Linux's PID_MAX_LIMIT on 64-bit: no process has a larger pid (a name that says otherwise
# was not written by a live owner).
_PID_MAX_LIMIT = 1 << 22


def owner_key() -> str:
    """What makes a pid name one process: `<host>-<boot id>-<PID namespace>`.

    A pid alone is not enough: another PID namespace (a container) sharing the
    directory numbers its processes from 1 too, and a boot starts the numbering
    again. The boot id is /proc/sys/kernel/random/boot_id, the namespace the
    inode of /proc/self/ns/pid; where either cannot be read, "x" (and so two such
    owners look alike, as before).
    """
    host = socket.gethostname().replace("-", "_")
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
    except OSError:
        boot = "x"
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "x"
    return f"{host}-{boot or 'x'}-{namespace}"


def sweep_dead_runs(parent: Path) -> list[Path]:
    """Remove offload directories under `parent` left by processes that are gone (a killed
    run's scratch: nothing reads it, it only takes disk). Returns what was removed.

    Only directories of this process's `owner_key` are judged: their pids are pids
    here. Another namespace's, another boot's or another host's are left alone,
    since no pid here says whether their owner lives.
    """
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    mine = f"{PREFIX}-{owner_key()}-"
    for entry in parent.glob(f"{mine}*"):
        pid = entry.name[len(mine) :].split("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` of this namespace lives; a number no pid can be is nobody's
    (os.kill would raise OverflowError for it)."""
    if not 0 < pid < _PID_MAX_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
