"""Host memory handed back when freed, for the runs whose point is to use less of it.

glibc serves a large allocation with its own mapping and unmaps it when freed,
but it raises that threshold to the size of each large block freed (up to
32 MiB). After the first few, a ZeRO-3 step's whole-unit buffers (the
gathered parameters, their gradients, the reduce-scatter input; tens of MB
each, allocated and freed per unit and step) come from the heap instead,
where freed blocks stay resident and fragment: the process's RSS grows step
after step above what it holds. Fixing the threshold returns each freed
block to the kernel; the price is faulting the pages in again each step
(benchmarks/zero_memory.py measures both). Disk offload turns it on by itself
(a `DiskOffloadPolicy` given to `fully_shard`, every optimizer streamed through
files: without it, the documented calls' peak RSS was 2x, and a 375M-parameter
MLP under a 700 MB cap was killed; docs/zero.md, "Offload"), and the Trainer at
zero_stage=3 too; an in-memory `fully_shard` script may call it before building
its model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["return_freed_memory"]

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
DEFAULT_THRESHOLD = 4 * 1024 * 1024
_done: list[int] = []


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve every allocation of `threshold` bytes or more from its own mapping, returned to
    the kernel when freed. True if set (glibc on Linux); elsewhere a no-op (False)."""
    if not sys.platform.startswith("linux"):
        return False
    if threshold in _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return False
    _done.append(threshold)
    return True
