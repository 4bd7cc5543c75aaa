"""Optimizer state moved by O_DIRECT: a window's state read from its files into a
page-aligned buffer, stepped there, and written back, with no page cache between.

Why: through a mapping, every page of a window is faulted in, dirtied, written back
and reclaimed, and those faults and that reclaim cost the CPU that two shared cores
owe the training. Measured on this machine (docs/zero.md, "Offload"): 256 MB of
state stepped through mappings took 0.31 s of CPU a step, through O_DIRECT buffers
0.05 s, in half the wall time.

What goes this way is what, during a step, the optimizer alone touches: its state
and stage 3's parameter shards (`StatePlace`, `ShardPlace`: each swapped for its
place in the slab while its window steps). Both stay mappings of their files for
every tool that reads them between steps (a checkpoint save, a live snapshot, a
gather), and the kernel keeps the two views coherent: a direct write drops the
file's cached pages, so a mapping's next read faults the new bytes in, and a
direct read first writes back pages dirtied through a mapping (a checkpoint
loaded in place). What it cannot show a mapping is bytes still in a buffer, so a
step returns only once its direct writes are done (`DirectMover.finish`). The
gradients stay mapped: backward writes them into the kernel's cache, from where
the step reads them, and zero_grad drops them unwritten.
A shard is read through the kernel's cache (`DirectEntry.cached`): its gather has
just put it there, and an O_DIRECT read would fetch it from the disk again.

A filesystem without O_DIRECT (tmpfs) keeps the mappings (`supported`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from phalanx.errors import OffloadError
from phalanx.ground.safe_files import random_name
from phalanx.offload.fused import like, local

__all__ = [
    "ALIGN",
    "DirectEntry",
    "DirectMover",
    "DirectWindow",
    "ShardPlace",
    "StatePlace",
    "aligned",
    "entries_of",
    "supported",
]

WRITES_IN_FLIGHT = 2
"""Windows being written by O_DIRECT at once: the next window's write waits for the oldest."""
SLABS = WRITES_IN_FLIGHT + 2
"""Slabs at once: the window stepping, the next one being read, and the writes in flight."""

ALIGN = 4096
"""O_DIRECT's alignment of addresses, offsets and lengths: a page, which every logical
block size in use divides."""

PIECE = 1 << 20
"""Bytes of one O_DIRECT request."""
LANES = 4
"""O_DIRECT requests in flight at once (a read and a write each have as many)."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGN`: a file's allocated length, a buffer's place."""
    return -(-nbytes // ALIGN) * ALIGN


def supported(directory: Path) -> bool:
    """Whether files in `directory` take O_DIRECT reads and writes (tmpfs refuses them). The
    probe's name is its own: ranks sharing a directory probe it at once (the planner's disk
    probe), and a shared name made all but one of them read "refused"."""
    probe = directory / random_name("direct-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        slab = Slab(ALIGN)
        page = slab.memory(0, ALIGN)
        return os.pwrite(fd, page, 0) == ALIGN and os.preadv(fd, [page], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


class Slab:
    """A page-aligned buffer of host memory (an anonymous mapping): freed when the last
    tensor or view of it goes. Its pages are faulted in by the first direct read into them,
    on the read thread's lanes (faulting them in at once, MAP_POPULATE, cost the training
    thread 0.4 ms a MB: 3% of a step of the 34M MLP)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = aligned(max(nbytes, 1))
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def memory(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._map)[offset : offset + nbytes]

    def tensor(self, offset: int, like_tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of `like_tensor`'s dtype and shape at `offset` (aligned) in the slab."""
        flat = self._bytes[offset : offset + like_tensor.nbytes].view(like_tensor.dtype)
        return flat.view(like_tensor.shape)


class SlabPool:
    """At most `most` slabs at a time, reused within a step: `take` waits for one that a
    write in flight gives back rather than make more. `clear` lets the free ones go."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._free: list[Slab] = []
        self._count = 0
        self._changed = threading.Condition()

    def take(self, nbytes: int) -> Slab:
        with self._changed:
            while True:
                fit = next((s for s in self._free if s.nbytes >= nbytes), None)
                if fit is not None:
                    self._free.remove(fit)
                    return fit
                if self._count < self.most:
                    self._count += 1
                    break
                if self._free:  # only smaller ones are free: one makes way for a larger
                    self._free.pop()
                    self._count -= 1
                    continue
                self._changed.wait()
        try:
            return Slab(nbytes)
        except BaseException:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()
            raise

    def give(self, slab: Slab) -> None:
        with self._changed:
            self._free.append(slab)
            self._changed.notify_all()

    def clear(self) -> None:
        with self._changed:
            self._count -= len(self._free)
            self._free.clear()


class StatePlace:
    """Where the optimizer keeps one state tensor: `state[key]`, one parameter's."""

    def __init__(self, state: dict[str, Any], key: str) -> None:
        self.state = state
        self.key = key
        self._given: torch.Tensor | None = None

    def swap_in(self, value: torch.Tensor, inner: torch.Tensor) -> None:
        self._given = like(value, inner)
        self.state[self.key] = self._given

    def swap_out(self, value: torch.Tensor, inner: torch.Tensor) -> None:
        now = self.state.get(self.key)
        if now is not self._given and torch.is_tensor(now):  # the step made a new one
            inner.copy_(local(now))
        self.state[self.key] = value
        self._given = None


class ShardPlace:
    """Where a stage-3 parameter keeps its shard: its DTensor's local tensor. The step
    updates the parameter object the optimizer knows; its local tensor is the slab's view
    while it does."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param

    def swap_in(self, value: torch.Tensor, inner: torch.Tensor) -> None:
        self.param._local_tensor = inner  # type: ignore[attr-defined]

    def swap_out(self, value: torch.Tensor, inner: torch.Tensor) -> None:
        self.param._local_tensor = value  # type: ignore[attr-defined]


@dataclass
class DirectEntry:
    place: StatePlace | ShardPlace
    """Where the step reads and writes the value: swapped for the slab's view while it steps."""
    value: torch.Tensor
    """The value as it is held between steps: a mapping (or a DTensor of one)."""
    path: Path
    offset: int
    """Where in the slab its bytes go (aligned)."""
    length: int
    """Its bytes rounded up to whole pages: what O_DIRECT moves (its file is that long)."""
    cached: bool = False
    """Read through the kernel's cache, not by O_DIRECT (written back by O_DIRECT all the
    same): a shard, which the step's own gather has just read into that cache."""


class DirectWindow:
    """The file-backed state of one window, read into one slab for its step."""

    def __init__(self, entries: list[DirectEntry], slab: Slab) -> None:
        self.entries = entries
        self.slab = slab

    @property
    def nbytes(self) -> int:
        return sum(e.length for e in self.entries)

    def read(self, opener: Callable[[Path, int], int], lanes: ThreadPoolExecutor) -> None:
        """Every entry's file into its place in the slab (blocking: on the read thread)."""
        self._move(opener, lanes, write=False)

    def write(self, opener: Callable[[Path, int], int], lanes: ThreadPoolExecutor) -> None:
        """Every entry's place in the slab back into its file (blocking: the write thread)."""
        self._move(opener, lanes, write=True)

    def _move(
        self, opener: Callable[[Path, int], int], lanes: ThreadPoolExecutor, write: bool
    ) -> None:
        """In pieces of `PIECE` bytes, `LANES` at once: one request at a time leaves a disk
        idle between them (a virtio disk here read 0.6x as fast by O_DIRECT as buffered)."""
        pieces = []
        for e in self.entries:
            for start in range(0, e.length, PIECE):
                length = min(PIECE, e.length - start)
                memory = self.slab.memory(e.offset + start, length)
                pieces.append((e.path, start, memory, write or not e.cached))
        moves = [
            lanes.submit(_transfer, opener, path, start, memory, write, direct)
            for path, start, memory, direct in pieces
        ]
        first: BaseException | None = None
        for move in moves:  # every piece ends before the slab is given back
            try:
                move.result()
            except BaseException as e:  # the first is raised once every piece has ended
                first = first or e
        if first is not None:
            raise first

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """While the block runs, the optimizer's state of this window is the slab's."""
        inners = []
        for e in self.entries:
            inners.append(self.slab.tensor(e.offset, local(e.value)))
            e.place.swap_in(e.value, inners[-1])
        try:
            yield
        finally:
            for e, inner in zip(self.entries, inners):
                e.place.swap_out(e.value, inner)


class DirectMover:
    """The O_DIRECT side of a streamed step (stream.py): its slabs, its write thread (so that
    the step's wait for its direct writes is no wait for write-backs through mappings),
    and its writes in flight. `timed(what, work, nbytes)` runs `work` timed on an I/O
    thread; `wait(future)` waits for one, timed."""

    def __init__(
        self,
        opener: Callable[[Path, int], int],
        timed: Callable[[str, Callable[[], None], int], None],
        wait: Callable[[Future[None]], None],
    ) -> None:
        self._opener = opener
        self._timed = timed
        self._wait = wait
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="phalanx-offload-direct")
        self._read_lanes = ThreadPoolExecutor(LANES, thread_name_prefix="phalanx-offload-rlane")
        self._write_lanes = ThreadPoolExecutor(LANES, thread_name_prefix="phalanx-offload-wlane")
        self._writes: list[Future[None]] = []
        self._slabs = SlabPool(SLABS)

    def window(self, entries: list[DirectEntry]) -> DirectWindow:
        """A slab for these entries (waits while every slab is in use: a write gives one back)."""
        return DirectWindow(entries, self._slabs.take(sum(e.length for e in entries)))

    def read(self, window: DirectWindow) -> None:
        """Read `window` from its files into its slab (blocking: on the read thread)."""
        window.read(self._opener, self._read_lanes)

    def write(self, window: DirectWindow) -> None:
        """Write `window`'s slab back into its files on the write thread; the slab then goes
        back to the pool."""

        def work() -> None:
            try:
                window.write(self._opener, self._write_lanes)
            finally:
                self._slabs.give(window.slab)

        self._writes.append(self._writer.submit(self._timed, "write", work, window.nbytes))
        while len(self._writes) > WRITES_IN_FLIGHT:
            self._wait(self._writes.pop(0))

    def finish(self, failed: bool) -> None:
        """Wait for every write in flight, then let the free slabs go (memory between steps is
        the training's). `failed`: the step is raising already; a window it abandoned keeps
        its slab, so the pool starts afresh, and a write's failure is not raised over it."""
        first: OffloadError | None = None
        for write in self._writes:
            try:
                self._wait(write)
            except OffloadError as e:
                first = first or e
        self._writes.clear()
        if failed:
            self._slabs = SlabPool(SLABS)
        else:
            self._slabs.clear()
        if first is not None and not failed:
            raise first

    def close(self) -> None:
        self.finish(failed=False)
        self._writer.shutdown(wait=True)
        self._read_lanes.shutdown(wait=True)
        self._write_lanes.shutdown(wait=True)


def entries_of(
    optimizer: Optimizer,
    params: list[torch.Tensor],
    path_of: Callable[[torch.Tensor], Path | None],
) -> list[DirectEntry]:
    """What of `params` lives whole in a file of its own that O_DIRECT moves (`path_of`):
    their state tensors and, for the sharded parameters the step updates (a gradient),
    their shards; each with its aligned place in a window's slab."""
    found: list[tuple[StatePlace | ShardPlace, torch.Tensor, Path, bool]] = []
    for p in params:
        shard = local(p)
        path = path_of(shard) if shard is not p and p.grad is not None else None
        if path is not None:
            found.append((ShardPlace(p), shard, path, True))
        state = optimizer.state.get(p) or {}
        for key, value in state.items():
            if torch.is_tensor(value) and (path := path_of(local(value))) is not None:
                found.append((StatePlace(state, key), value, path, False))
    out: list[DirectEntry] = []
    offset = 0
    for place, value, path, cached in found:
        length = aligned(local(value).nbytes)
        out.append(DirectEntry(place, value, path, offset, length, cached))
        offset += length
    return out


def _transfer(
    opener: Callable[[Path, int], int],
    path: Path,
    start: int,
    memory: memoryview,
    write: bool,
    direct: bool = True,
) -> None:
    """`memory` from (or into) file `path` at byte `start`, by O_DIRECT (`direct`) or through
    the kernel's cache."""
    fd = opener(path, (os.O_WRONLY if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while done < memory.nbytes:
            rest = memory[done:]
            at = start + done
            moved = os.pwrite(fd, rest, at) if write else os.preadv(fd, [rest], at)
            if moved <= 0:
                raise OffloadError(
                    f"offload file {path} ended at byte {done} of {memory.nbytes} (truncated "
                    "while the run used it?) — keep the offload directory for the whole run, "
                    "then resume from the last checkpoint"
                )
            done += moved
    except OSError as e:
        raise OffloadError(
            f"offload file {path}: the direct {'write' if write else 'read'} failed "
            f"({e.strerror or e}) — check the disk, then resume from the last checkpoint"
        ) from None
    finally:
        os.close(fd)
