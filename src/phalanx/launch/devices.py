"""Count this machine's GPUs and CPU cores without importing torch.

`torch.cuda.device_count()` would cost seconds of import time and, on some
drivers, create a CUDA context in the launcher; the driver's own files and
`nvidia-smi` answer the same question for free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# nvidia-smi can stall on a wedged driver; a launcher must not.
_NVIDIA_SMI_TIMEOUT_S = 10.0


def physical_gpu_count(proc_dir: Path = NVIDIA_PROC_GPUS) -> int:
    """GPUs the NVIDIA driver reports: one directory per GPU under /proc, else `nvidia-smi -L`."""
    try:
        return sum(1 for _ in proc_dir.iterdir())
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listing.returncode != 0:
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def visible_device_limit(env: Mapping[str, str]) -> int | None:
    """How many devices CUDA_VISIBLE_DEVICES lets a process see, or None when it is unset.

    CUDA stops reading the list at the first invalid entry, so "-1" (a common
    way to hide every GPU) and an empty value both mean zero.
    """
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    count = 0
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        count += 1
    return count


def gpu_count(env: Mapping[str, str] | None = None, proc_dir: Path = NVIDIA_PROC_GPUS) -> int:
    """GPUs a worker started from this environment could use."""
    physical = physical_gpu_count(proc_dir)
    limit = visible_device_limit(os.environ if env is None else env)
    return physical if limit is None else min(physical, limit)


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)
