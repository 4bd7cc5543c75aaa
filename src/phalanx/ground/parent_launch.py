"""What the process that started us asked for, when it set no launcher variables.

`accelerate launch --num_processes 2 train.py` on a machine without GPUs runs
ONE process (accelerate starts several only with `--multi_gpu`, its mpirun
form, or a config file saying so), exports no RANK or WORLD_SIZE, and the
script trains at world 1 with nobody saying so. The parent's command line
is the only record of what was asked: read it, so that `phalanx.init` can
say what happened instead. Torch-free, Linux's /proc only (elsewhere: None).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["accelerate_processes_asked", "describe_single_accelerate_process"]


def _parent_argv(ppid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def accelerate_processes_asked(argv: list[str]) -> int | None:
    """The `--num_processes` of an `accelerate launch` command line; None if it is not one
    (or does not say)."""
    names = [Path(a).name for a in argv]
    launches = any(
        n == "accelerate.commands.launch"
        or (n == "accelerate" and names[i + 1 : i + 2] == ["launch"])
        for i, n in enumerate(names)
    )
    if not launches:
        return None
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            if arg == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
                return int(argv[i + 1])
            if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return None


def describe_single_accelerate_process(ppid: int | None = None) -> str | None:
    """One line saying accelerate started one process where more were asked; None when the
    parent is no such `accelerate launch`."""
    argv = _parent_argv(os.getppid() if ppid is None else ppid)
    asked = accelerate_processes_asked(argv)
    if asked is None or asked <= 1:
        return None
    return (
        f"accelerate launch was asked for --num_processes {asked} but started this one "
        "process alone (without GPUs it starts several only with --multi_gpu, or its "
        "mpirun form) — add --multi_gpu, or run phalanx launch --nproc-per-node "
        f"{asked} train.py"
    )
