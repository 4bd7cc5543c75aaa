"""Allocate and touch 64 MB through glibc's malloc (ctypes: no torch, so it starts fast) and
write OUTDIR/huge_<rank>.json: GLIBC_TUNABLES as the worker got it, whether malloc asked the
kernel for huge pages for that block (its mapping's `hg` flag: madvise(MADV_HUGEPAGE)), and
how much of this process's anonymous memory the kernel backs with them."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from pathlib import Path

from _common import rank, write_atomically

SIZE = 64 << 20


def anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` was madvised MADV_HUGEPAGE (VmFlags `hg`)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


def main() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)  # faulted in: a huge page at a time where malloc asked
    report = {
        "tunables": os.environ.get("GLIBC_TUNABLES"),
        "advised": advised_huge(block),
        "anon_huge_kb": anon_huge_kb(),
    }
    write_atomically(Path(sys.argv[1]) / f"huge_{rank()}.json", json.dumps(report))


if __name__ == "__main__":
    main()
