"""How should offloaded state move between files and memory? The mechanisms side by side.

One process holds `--state-mb` of state in files (tensors of `--tensor-mb`, as a
rank's offloaded shards and Adam moments are) and runs "steps" over it the way
the offloaded optimizer does: a window at a time (`--window-mb`), the next
window read while the current one is updated in place (an elementwise pass,
as Adam's) and the previous one written back and dropped from memory, so
memory stays bounded. Variants, interleaved round by round in a balanced order
(interleave.py), each over files of its own:

- `mmap`: phalanx's own code (phalanx.offload.files): each tensor a MAP_SHARED
  mapping of its file; MADV_POPULATE_WRITE on a read thread, msync +
  MADV_PAGEOUT on a write thread;
- `pread`: a pool of three window buffers; preadv / pwritev of 8 MB chunks by a
  pool of `--threads` threads, then fdatasync + POSIX_FADV_DONTNEED to drop the
  page cache (bounded, as the mappings are);
- `direct`: the same pool with O_DIRECT (page-aligned buffers): no page cache;
- `uring`: the same pool, the chunks queued on an io_uring (the `liburing`
  package, 16 deep per I/O thread; only where it imports).

Reported per variant: the median step, MB/s moved (read + written), and the
process's CPU seconds per step (on a 2-core machine the I/O's CPU is taken from
the training), with ratios to `mmap`.

    python benchmarks/offload_io.py                         # ~1 minute
    /tmp/uring/bin/python benchmarks/offload_io.py          # with the io_uring variant
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import interleave
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload_io.json"
MB = 2**20
CHUNK = 8 * MB


def update(t: torch.Tensor) -> None:
    """The step's work on a window: one elementwise read-modify-write pass, as Adam's."""
    t.mul_(0.999).add_(1e-3)


# ---------------------------------------------------------------------------- mmap
class MmapState:
    """phalanx's mechanism, through phalanx's own code."""

    def __init__(self, root: Path, sizes: list[int]) -> None:
        from phalanx.offload.files import OffloadFiles

        self.files = OffloadFiles(root, 0, "offload_io")
        self.tensors = [self.files.tensor((n // 4,), torch.float32) for n in sizes]
        self.reader = ThreadPoolExecutor(1)
        self.writer = ThreadPoolExecutor(1)

    def step(self, windows: list[list[int]]) -> None:
        pick = [[self.tensors[i] for i in w] for w in windows]
        ahead = self.reader.submit(self.files.populate, pick[0], True)
        writes: list[Future[None]] = []
        for i, window in enumerate(pick):
            ahead.result()
            if i + 1 < len(pick):
                ahead = self.reader.submit(self.files.populate, pick[i + 1], True)
            for t in window:
                update(t)
            writes.append(self.writer.submit(self.files.release, window))
            while len(writes) > 2:
                writes.pop(0).result()
        for w in writes:
            w.result()

    def close(self) -> None:
        self.reader.shutdown()
        self.writer.shutdown()
        self.files.close()


# ---------------------------------------------------------------------- buffer pool
class PoolState:
    """Files read into and written from a pool of three window buffers."""

    def __init__(self, root: Path, sizes: list[int], window: int, threads: int, how: str) -> None:
        self.how = how
        root.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if how == "direct" else 0)
        self.fds, self.sizes = [], sizes
        for k, n in enumerate(sizes):
            fd = os.open(root / f"{k:04d}.bin", flags, 0o600)
            os.posix_fallocate(fd, 0, n)
            self.fds.append(fd)
        # mmap'd anonymous memory is page-aligned (O_DIRECT needs it); liburing takes bytearrays
        make = bytearray if how == "uring" else (lambda n: mmap.mmap(-1, n))
        self.buffers = [make(window) for _ in range(3)]
        self.pool = ThreadPoolExecutor(threads)
        self.io = ThreadPoolExecutor(2)  # one reading, one writing: each fans out to the pool
        self.ring = UringIO() if how == "uring" else None

    def _chunks(self, window: list[int], buf: Any) -> list[tuple[int, memoryview, int]]:
        """(fd, buffer slice, file offset) for every 8 MB chunk of the window's files."""
        out, at, view = [], 0, memoryview(buf)
        for i in window:
            for off in range(0, self.sizes[i], CHUNK):
                n = min(CHUNK, self.sizes[i] - off)
                out.append((self.fds[i], view[at : at + n], off))
                at += n
        return out

    def _read(self, window: list[int], buf: Any) -> None:
        chunks = self._chunks(window, buf)
        if self.ring is not None:
            self.ring.run("read", chunks, buf)
            return
        list(self.pool.map(lambda c: os.preadv(c[0], [c[1]], c[2]), chunks))

    def _write(self, window: list[int], buf: Any) -> None:
        chunks = self._chunks(window, buf)
        if self.ring is not None:
            self.ring.run("write", chunks, buf)
        else:
            list(self.pool.map(lambda c: os.pwritev(c[0], [c[1]], c[2]), chunks))
        if self.how != "direct":  # the page cache holds what was written: drop it, bounded
            for i in window:
                os.fdatasync(self.fds[i])
                os.posix_fadvise(self.fds[i], 0, 0, os.POSIX_FADV_DONTNEED)

    def step(self, windows: list[list[int]]) -> None:
        bufs = self.buffers
        ahead = self.io.submit(self._read, windows[0], bufs[0])
        writes: list[Future[None]] = []
        for i, window in enumerate(windows):
            ahead.result()
            if i + 1 < len(windows):
                while len(writes) > 1:  # the buffer read next is the one written two back
                    writes.pop(0).result()
                ahead = self.io.submit(self._read, windows[i + 1], bufs[(i + 1) % 3])
            nbytes = sum(self.sizes[k] for k in window)
            update(torch.frombuffer(bufs[i % 3], dtype=torch.float32, count=nbytes // 4))
            writes.append(self.io.submit(self._write, window, bufs[i % 3]))
        for w in writes:
            w.result()

    def close(self) -> None:
        self.io.shutdown()
        self.pool.shutdown()
        for fd in self.fds:
            os.close(fd)


class UringIO:
    """Reads or writes of many chunks queued on one io_uring per I/O thread."""

    DEPTH = 16

    def __init__(self) -> None:
        import threading

        self._local = threading.local()

    def _ring(self) -> Any:
        import liburing

        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = liburing.Ring()
            liburing.io_uring_queue_init(self.DEPTH, ring)
            self._local.cqe = liburing.Cqe()
        return ring

    def run(self, what: str, chunks: list[tuple[int, memoryview, int]], buf: bytearray) -> None:
        import liburing as L

        ring = self._ring()
        cqe = self._local.cqe
        # liburing's prep calls take a bytearray, not a view: one per chunk, copied in/out
        pending: dict[int, tuple[bytearray, memoryview]] = {}
        todo = list(enumerate(chunks))
        while todo or pending:
            while todo and len(pending) < self.DEPTH:
                k, (fd, view, off) = todo.pop(0)
                data = bytearray(view) if what == "write" else bytearray(len(view))
                sqe = L.io_uring_get_sqe(ring)
                prep = L.io_uring_prep_write if what == "write" else L.io_uring_prep_read
                prep(sqe, fd, data, off)
                L.io_uring_sqe_set_data64(sqe, k)
                pending[k] = (data, view)
            L.io_uring_submit(ring)
            L.io_uring_wait_cqe(ring, cqe)
            done = cqe[0]
            k, res = done.user_data, done.res
            L.io_uring_cqe_seen(ring, done)
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            data, view = pending.pop(k)
            if what == "read":
                view[:] = data


# ------------------------------------------------------------------------------ main
def windows_of(sizes: list[int], window: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if used and used + n > window:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def variants(args: argparse.Namespace) -> list[str]:
    names = ["mmap", "pread", "direct"]
    try:
        import liburing  # noqa: F401

        names.append("uring")
    except ImportError:
        print("liburing does not import here: the io_uring variant is left out", file=sys.stderr)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--tensor-mb", type=int, default=8)
    parser.add_argument("--window-mb", type=int, default=64)
    parser.add_argument("--threads", type=int, default=4, help="the buffer variants' I/O pool")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/phalanx-offload-io")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    sizes = [args.tensor_mb * MB] * (args.state_mb // args.tensor_mb)
    windows = windows_of(sizes, args.window_mb * MB)
    names = variants(args)
    makers: dict[str, Callable[[], Any]] = {
        "mmap": lambda: MmapState(root / "mmap", sizes),
        **{
            n: functools.partial(PoolState, root / n, sizes, args.window_mb * MB, args.threads, n)
            for n in ("pread", "direct", "uring")
        },
    }
    states = {n: makers[n]() for n in names}
    for s in states.values():
        s.step(windows)  # untimed: the first pass allocates the blocks' extents
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    rounds = interleave.balanced_rounds(args.rounds, args.rounds, len(names))
    for r in range(rounds):
        for n in interleave.balanced_order(r, names):
            for _ in range(args.per_round):
                u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                states[n].step(windows)
                t1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                times[n].append(t1 - t0)
                cpu[n].append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
    for s in states.values():
        s.close()
    shutil.rmtree(root, ignore_errors=True)
    moved = 2 * sum(sizes) / MB
    med = {n: statistics.median(times[n]) for n in names}
    report = {
        "config": {**vars(args), "out": str(args.out), "windows": len(windows)},
        "median_step_ms": {n: med[n] * 1e3 for n in names},
        "moved_mb_s": {n: moved / med[n] for n in names},
        "cpu_s_per_step": {n: statistics.median(cpu[n]) for n in names},
        "step_over_mmap": {n: med[n] / med["mmap"] for n in names},
        "steps": times,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
