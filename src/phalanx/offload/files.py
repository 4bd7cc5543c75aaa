"""Tensors that live in files: the scratch directory of one process's offloaded state.

Each tensor is a shared memory mapping of its own file, so it is an ordinary
CPU tensor to everything that reads it (the optimizer, clipping, DCP saves):
no tool needs to know it is on disk, and none can read a stale copy. What is
resident is the kernel's business, steered by advice (`prefetch` ahead of
use, `release` behind it: written back, then dropped), which keeps this
process's share of host memory to a window around what it is working on, and
lets the kernel reclaim the rest under a memory limit. Why mappings rather
than reads into buffers: docs/zero.md, "Offload".

The directory is scratch: fresh for each process (never reused, so a restart
cannot read an earlier run's file), removed at a clean exit; one left by a
killed run is removed by the next run that finds its owner dead. Its name
carries its owner's pid together with what makes that pid mean one process
(`owner_key`): the host, the boot, and the PID namespace. A sweep judges only
the directories of its own key, since a pid read in another namespace (another
container sharing the directory) or from before a reboot names some other
process or none: another namespace's live scratch was deleted as dead. Every file
is allocated whole when created (`posix_fallocate`): a full disk is an error
at that moment, never a SIGBUS when a page is later written. A file or the
directory removed under a running process (a cleanup job) is an `OffloadError`
when next opened, not a raw FileNotFoundError.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.errors import OffloadError
from phalanx.offload.direct import aligned
from phalanx.offload.scratch import PREFIX, owner_key, sweep_dead_runs

__all__ = ["OffloadFiles", "Region", "read_at", "write_at"]

PAGE = mmap.PAGESIZE
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault these pages in now
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault them in writable (and dirty) now
_MS_SYNC = 4
_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_ZERO_RANGE = 0x10  # Linux 3.15+, ext4 and xfs: zeroes, blocks kept allocated

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# ctypes releases the GIL around these calls: advice runs beside the training thread.
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


@dataclass(frozen=True)
class Region:
    """One file-backed tensor's mapping: where it starts and how many bytes it spans."""

    address: int
    nbytes: int
    path: Path

    def pages(self) -> tuple[int, int]:
        """The page-aligned (address, length) covering the region."""
        start = self.address - self.address % PAGE
        stop = -(-(self.address + self.nbytes) // PAGE) * PAGE
        return start, stop - start


class OffloadFiles:
    """A process's offload directory under `parent`, and the file-backed tensors in it."""

    def __init__(self, parent: str | os.PathLike[str], rank: int, what: str) -> None:
        self.parent = Path(parent)
        self.what = what
        """What the directory is for, named in errors (e.g. "zero_offload_dir")."""
        sweep_dead_runs(self.parent)
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            prefix = f"{PREFIX}-{owner_key()}-{os.getpid()}-rank{rank}-"
            self.directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        except OSError as e:
            raise OffloadError(
                f"{what}={self.parent}: cannot create the offload directory there "
                f"({e.strerror or e}) — point it at a writable directory on a local disk"
            ) from None
        self._regions: dict[int, Region] = {}
        self._count = 0
        self._closed = False
        atexit.register(self.close)
        self.can_discard = self._zero_range_works()
        """Whether `discard` can drop pages unwritten here (not on tmpfs, for one)."""
        self.direct = False
        """Whether the optimizer's step moves its state through these files by O_DIRECT
        (direct.py); the policy turns it on where the filesystem takes it."""

    def tensor(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor backed by a new file of its own (allocated whole)."""
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        self._count += 1
        path = self.directory / f"{self._count:06d}.bin"
        fd = self.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._allocate(fd, aligned(nbytes), path)  # whole pages: O_DIRECT moves only those
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file; the descriptor is not needed
        # The tensor holds the mapping (its buffer) alive; the file lives as long as it does.
        flat = torch.frombuffer(mapping, dtype=dtype, count=numel)
        self._regions[flat.data_ptr()] = Region(flat.data_ptr(), nbytes, path)
        return flat.view(shape)

    def copy(self, source: torch.Tensor) -> torch.Tensor:
        """`source`'s values in a new file-backed tensor of its shape and dtype."""
        out = self.tensor(source.shape, source.dtype)
        with torch.no_grad():
            out.copy_(source)
        return out

    def _allocate(self, fd: int, nbytes: int, path: Path) -> None:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OffloadError(
                    f"{self.what}={self.parent}: the disk is full ({nbytes / 2**20:.1f} MB "
                    f"more needed for offloaded state) — free space there, or point "
                    f"{self.what} at a larger disk"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OffloadError(
                    f"{self.what}={self.parent}: cannot write offload file {path.name} "
                    f"({e.strerror or e}) — point it at a writable directory on a local disk"
                ) from None
            os.ftruncate(fd, nbytes)  # a filesystem without fallocate: sparse, best effort

    def region(self, tensor: torch.Tensor) -> Region | None:
        """The mapping `tensor` (a file-backed tensor, or a view of one) lies in."""
        base = tensor.untyped_storage().data_ptr()
        return self._regions.get(base)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.region(tensor) is not None

    def path_of(self, tensor: torch.Tensor) -> Path | None:
        """The file `tensor` spans whole (not a view of part of one), else None."""
        region = self.region(tensor)
        if region is None or tensor.data_ptr() != region.address:
            return None
        return region.path if tensor.nbytes == region.nbytes else None

    @contextlib.contextmanager
    def through_file(self, tensor: torch.Tensor) -> Iterator[int]:
        """A descriptor on `tensor`'s file, for `write_at`/`read_at`: bytes that go through
        it reach the kernel's cache without entering this process's resident set, as the
        mapping's pages would (coherent with the mapping: one page cache)."""
        region = self.region(tensor)
        assert region is not None, "not a tensor of these files"
        fd = self.open_file(region.path, os.O_RDWR)
        try:
            yield fd
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ advice
    def populate(self, tensors: list[torch.Tensor], writable: bool = False) -> None:
        """Read these tensors' pages into memory and map them (blocking: call it off the
        training thread, ahead of use). `writable`: map them for writing too, for tensors
        about to be written: a page of a shared file mapping is first mapped read-only, so
        the first write to each page would fault again, on the thread that writes."""
        advice = _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ
        for region in self._regions_of(tensors):
            if _madvise(region, advice) != 0:  # before Linux 5.14: read ahead
                _madvise(region, _MADV_WILLNEED)

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Write these tensors' dirty pages back, then drop them from memory (blocking: call
        it off the training thread). The write-back of all of them is started before any
        is waited for, so the disk sees them queued together, not one tensor at a time
        (msync per tensor: measured slower, docs/zero.md "Offload"); nothing here needs them
        durable, only clean, so no journal commit is asked for."""
        regions = self._regions_of(tensors)
        fds: list[int] = []
        for region in regions:
            try:
                fd = self.open_file(region.path, os.O_RDWR)
            except OffloadError:
                for opened in fds:
                    os.close(opened)
                raise
            fds.append(fd)
            _libc.sync_file_range(fd, 0, region.nbytes, _SYNC_FILE_RANGE_WRITE)
        for fd, region in zip(fds, regions):
            wait = (
                _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
            )
            if _libc.sync_file_range(fd, 0, region.nbytes, wait) != 0:
                start, length = region.pages()  # where it is refused: the mapping's own way
                _libc.msync(start, length, _MS_SYNC)
            os.close(fd)
            if _madvise(region, _MADV_PAGEOUT) != 0:  # older kernels: at least unmap them
                _madvise(region, _MADV_DONTNEED)

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Unmap these tensors' pages from this process without writing them: they stay in
        the kernel's cache (its to write back, or `discard`'s to drop)."""
        for region in self._regions_of(tensors):
            _madvise(region, _MADV_DONTNEED)

    def remove(self, tensors: list[torch.Tensor]) -> None:
        """Delete these tensors' files: their disk space goes once the tensors are freed (a
        mapping keeps its file's data until then)."""
        for region in self._regions_of(tensors):
            self._regions.pop(region.address, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(region.path)

    def discard(self, tensors: list[torch.Tensor]) -> None:
        """Zero these tensors by dropping their pages, dirty or not, unwritten: for values
        nobody will read again (a gradient set to None), whose write-back and read-back
        would be wasted I/O. Their blocks stay allocated (FALLOC_FL_ZERO_RANGE), so the
        next write into them cannot meet a full disk; without `can_discard`, a no-op."""
        if not self.can_discard:
            return
        for region in self._regions_of(tensors):
            fd = self.open_file(region.path, os.O_RDWR)
            try:
                mode = _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE
                _libc.fallocate(fd, mode, 0, region.nbytes)
            finally:
                os.close(fd)

    def open_file(self, path: Path, flags: int, mode: int = 0o600) -> int:
        """os.open, with a file or directory removed under the run said in one line."""
        try:
            return os.open(path, flags, mode)
        except FileNotFoundError:
            gone = (
                f"the offload directory {self.directory}"
                if not self.directory.is_dir()
                else f"offload file {path}"
            )
            raise OffloadError(
                f"{self.what}={self.parent}: {gone} was deleted while the run used it (by a "
                f"cleanup job?) — keep {self.what} for the whole run, then resume from the last "
                "checkpoint"
            ) from None

    def _zero_range_works(self) -> bool:
        probe = self.directory / "zero-range-probe"
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            mode = _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE
            os.ftruncate(fd, PAGE)
            return int(_libc.fallocate(fd, mode, 0, PAGE)) == 0
        finally:
            os.close(fd)
            os.unlink(probe)

    def _regions_of(self, tensors: list[torch.Tensor]) -> list[Region]:
        return [r for t in tensors if (r := self.region(t)) is not None]

    def resident_bytes(self) -> int:
        """How many bytes of the files are in this process's memory now (mincore)."""
        total = 0
        for region in self._regions.values():
            total += _resident(region)
        return total

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._regions.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove the directory (the mappings stay valid until their tensors are freed)."""
        if self._closed:
            return
        self._closed = True
        self._regions.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


def _madvise(region: Region, advice: int) -> int:
    start, length = region.pages()
    return int(_libc.madvise(start, length, advice))


_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident(region: Region) -> int:
    start, length = region.pages()
    vec = ctypes.create_string_buffer(length // PAGE)
    if _libc.mincore(start, length, vec) != 0:
        return 0
    return sum(b & 1 for b in vec.raw) * PAGE


def write_at(fd: int, data: torch.Tensor, offset: int) -> None:
    """`data`'s bytes (a contiguous CPU tensor) into file `fd` from byte `offset` on."""
    view = data.detach().reshape(-1).view(torch.uint8).numpy().data
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def read_at(fd: int, out: torch.Tensor, offset: int) -> int:
    """Bytes of file `fd` from `offset` on into `out` (a contiguous uint8 CPU tensor): how
    many there were (fewer than `out` holds at the file's end)."""
    view, total = out.numpy().data, 0
    while view.nbytes:
        done = os.preadv(fd, [view], offset)
        if done == 0:
            break
        view, offset, total = view[done:], offset + done, total + done
    return total
