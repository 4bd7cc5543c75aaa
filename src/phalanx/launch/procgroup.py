"""Signals to whole process groups, and whether anything in a group still runs.

Each worker starts in its own session, so its process group holds the
worker and everything it forks (DataLoader workers, compilers, shells).
Signalling the group reaches them all; signalling the worker alone would
leave its children running after the job ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from phalanx.errors import ExitCode

_PROC = Path("/proc")


def signal_group(pgid: int, signum: int) -> None:
    """Send `signum` to every process in group `pgid`; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def live_groups(pgids: set[int]) -> set[int]:
    """The groups among `pgids` in which some process still runs, in one pass over /proc.

    Zombies do not count: an orphan whose parent died is reparented to PID 1,
    and in many containers PID 1 never reaps, so the zombie would keep the
    group "alive" forever. /proc tells zombies apart; without /proc (macOS)
    we fall back to asking the kernel whether each group exists at all.
    """
    if not _PROC.is_dir():
        return {pgid for pgid in pgids if _group_exists(pgid)}
    live: set[int] = set()
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            pgid = _running_pgid(entry)
            if pgid in pgids:
                live.add(pgid)
    return live


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running_pgid(entry: Path) -> int | None:
    """The process group of /proc/<pid>, or None when it is gone or a zombie."""
    try:
        stat = (entry / "stat").read_text()
    except OSError:  # the process exited while we looked
        return None
    # The command name in parentheses may contain spaces; the fields after it do not.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 3 or fields[0] in ("Z", "X"):
        return None
    return int(fields[2])


def exit_code_of(returncode: int) -> int:
    """A shell's exit status for a child's Popen returncode: 128 + signum for a signal."""
    return 128 - returncode if returncode < 0 else returncode


# What phalanx's own exit codes mean (errors.ExitCode; docs/clusters.md, "Exit codes").
_MEANINGS: dict[int, str] = {
    ExitCode.CONFIGURATION: "a configuration error",
    ExitCode.INFRASTRUCTURE: "a peer, the network or the store failed",
}


def describe_returncode(returncode: int) -> str:
    """'exit code 3', 'exit code 2 (a configuration error)', or 'killed by SIGKILL (signal
    9)'."""
    if returncode >= 0:
        meaning = _MEANINGS.get(returncode)
        return f"exit code {returncode}" + (f" ({meaning})" if meaning else "")
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by {name} (signal {signum})"


def tagged_processes(variable: str, value: str) -> set[int]:
    """Running processes whose environment holds `variable=value` (Linux /proc only).

    A worker and everything it starts inherit the tag, so this finds them even
    outside their process group, and a recycled PID never carries it.
    """
    if not _PROC.is_dir():
        return set()
    needle = f"{variable}={value}".encode()
    found: set[int] = set()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0") and _running_pgid(entry) is not None:
            found.add(int(entry.name))
    return found


def signal_processes(pids: set[int], signum: int) -> None:
    """Send `signum` to each of `pids`; one already gone is fine."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
