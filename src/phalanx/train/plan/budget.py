"""A rank's memory budget when none is given: its cgroup's limit, else the memory free on
this host shared by its ranks (or, for a CUDA device, the device's free memory).

The cgroup limit is read along this process's own path up to the root (v2:
`memory.max`; v1: `memory.limit_in_bytes`; the smallest on the way counts, since a
parent's limit binds its children). A limit is what the kernel enforces, so it
wins over what happens to be free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["cgroup_limit", "detect_budget", "free_memory", "parse_size"]

_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # v1 reports "no limit" as a huge number near 2**63
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'2GB', '1.5G', '700MB', '700M', '123456' (bytes) -> bytes (powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise ValueError(f"{text!r} is not a size — e.g. 2GB, 700MB or a number of bytes")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit])


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: Path = _ROOT) -> int | None:
    """The memory limit of this process's cgroup (the smallest up its path), or None."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            limits += _limits_up(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_up(root / "memory", path, "memory.limit_in_bytes")
    real = [n for n in limits if n < _NO_LIMIT]
    return min(real) if real else None


def _limits_up(base: Path, path: str, name: str) -> list[int]:
    found = []
    current = Path(path.strip() or "/")
    while True:
        text = _read(base / str(current).lstrip("/") / name)
        if text is not None and text != "max" and text.isdigit():
            found.append(int(text))
        if current == current.parent:
            return found
        current = current.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def free_memory(local_ranks: int) -> int | None:
    """MemAvailable on this host, divided among its `local_ranks` ranks."""
    text = _read(Path("/proc/meminfo"))
    if text is None:
        return None
    match = re.search(r"MemAvailable:\s+(\d+) kB", text)
    return None if match is None else int(match.group(1)) * 1024 // max(1, local_ranks)


def detect_budget(device_type: str = "cpu", local_ranks: int | None = None) -> tuple[int, str]:
    """(bytes, where from): the cgroup's limit, the CUDA device's free memory, or free RAM."""
    limit = cgroup_limit()
    if limit is not None:
        return limit, "the cgroup's memory limit"
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free), "the CUDA device's free memory"
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = free_memory(ranks)
    if available is None:
        raise ValueError("cannot read /proc/meminfo — give the budget (e.g. --budget 8GB)")
    return available, f"free memory on this host / {ranks} local ranks"
