"""How fast this machine is, for the planner's step times: a short probe, every rank at once.

Compute is a matrix product timed on this process's threads; memory is a copy
into a buffer already touched, and a copy into one allocated for it (whose pages
the kernel faults in afresh: stage 3 allocates its gathers and reductions for each
use, and a planned run returns freed memory to the kernel); the optimizer is
torch's AdamW stepping a 16 MB tensor, every rank at once (fused, as the offloaded
step runs it, and per tensor, torch's CPU default); the collectives are the ones ZeRO issues
(all-reduce, all-gather, reduce-scatter) timed on the run's group at two sizes,
so each has a latency and a bandwidth (on gloo phalanx's reduce-scatter is an
all-reduce, priced as one); the disk is a file in the offload directory, every
rank at once (the share of the disk a rank gets when all offload), written and
synced then read with its pages dropped (stage 3's shards, through the page
cache), and written and read by O_DIRECT (the optimizer's state). The libraries are
this process's resident memory before any of the model exists. Every rank
measures; the slowest figure of any rank is kept, so all ranks plan alike. Run as a
job of its own by probe_job.py (what `phalanx plan` launches).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from phalanx.parallel.collectives import (
    is_gloo,
    start_all_gather,
    start_reduce_scatter,
    wait_all_gather,
    wait_reduce_scatter,
)
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.runtime.wire import all_gather_json

__all__ = ["Rates", "measure_rates", "resident_bytes"]

_T = TypeVar("_T")

_SMALL, _LARGE = 256 << 10, 16 << 20
_DISK_BYTES = 64 << 20


@dataclass(frozen=True)
class Rates:
    """Measured speeds (bytes and operations per second) and this process's own memory."""

    flops_per_s: float
    memory_bytes_per_s: float
    """Bytes a copy reads and writes per second: what a micro-batch's pass over the
    weights costs on top of its operations."""
    fresh_copy_bytes_per_s: float
    """Bytes per second copied into memory allocated for the copy (its pages faulted in):
    what stage 3's gathered parameters and reduce-scatter inputs cost, made for each use."""
    adam_fused_bytes_per_s: float
    """Parameter bytes AdamW steps per second, fused (the offloaded step's kernel)."""
    adam_loop_bytes_per_s: float
    """... per tensor (torch's CPU default: the in-memory Trainer's step)."""
    collective_latency_s: dict[str, float]
    collective_bytes_per_s: dict[str, float]
    busy_all_reduce_bytes_per_s: float
    """An all-reduce's rate while this rank's core writes fresh memory beside it, as a
    backward writes its gradients: what stage 2's reductions send during the backward
    (0.3-0.5 of the idle rate on 2 cores shared by 2 ranks)."""
    """Per collective ("all_reduce", "all_gather", "reduce_scatter"): the time of a call
    is latency + bytes / rate, bytes being the whole tensor (all ranks' parts)."""
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    """Through the page cache: how stage 3's shards and gradients in files move."""
    disk_direct_read_bytes_per_s: float
    disk_direct_write_bytes_per_s: float
    """By O_DIRECT, as a disk offload moves the optimizer's state (offload/direct.py); the
    page cache's rates where the filesystem refuses O_DIRECT."""
    libraries_bytes: float
    """Resident memory of the process before the model exists (torch, phalanx, the group)."""

    def collective_s(self, kind: str, nbytes: float, calls: int = 1) -> float:
        """Seconds of `calls` collectives of `kind` moving `nbytes` in all."""
        if nbytes <= 0:
            return 0.0
        return calls * self.collective_latency_s[kind] + nbytes / self.collective_bytes_per_s[kind]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def resident_bytes() -> float:
    """This process's resident memory now (VmRSS)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        status = Path("/proc/self/status").read_text()
        return float(status.split("VmRSS:")[1].split()[0]) * 1024
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _warm_up() -> None:
    """What a training process has once it has stepped, besides its model: autograd's
    engine, a DataLoader's pass, an optimizer's step (the run's random state kept)."""
    from torch.utils.data import DataLoader, TensorDataset

    with torch.random.fork_rng(devices=[]):
        layer = torch.nn.Linear(16, 16)
        optimizer = torch.optim.AdamW(layer.parameters())
        for (x,) in DataLoader(TensorDataset(torch.ones(8, 16)), batch_size=4):
            layer(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def _best_s(run: Callable[[], object], rounds: int = 3) -> float:
    return max(min(_times_s(run, rounds)), 1e-9)


def _times_s(run: Callable[[], object], rounds: int) -> list[float]:
    """`rounds` timings of `run`, after one untimed (buffers, connections, the allocator, an
    optimizer's state made, its pages touched)."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def _flops_per_s() -> float:
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    return 2 * 512 * 1024 * 1024 / _best_s(lambda: a @ b)


def _memory_bytes_per_s() -> float:
    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    return 2 * src.nbytes / _best_s(lambda: dst.copy_(src))


def _fresh_copy_bytes_per_s() -> float:
    """A 64 MB copy into a tensor made for it, the median of three: with freed memory given
    back to the kernel (measure_rates), every copy faults its destination in again."""
    src = torch.ones(16 << 20)
    return src.nbytes / _median_s(lambda: torch.empty_like(src).copy_(src))


def _adam_bytes_per_s(fused: bool) -> float:
    """AdamW over a 16 MB parameter (with its gradient and state 64 MB, past the last-level
    cache of most CPUs: a model's state streams through memory), the median step of three.
    Not larger: the Trainer probes under the budget it plans for (a cgroup's limit)."""
    param = torch.nn.Parameter(torch.zeros(4 << 20))
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=fused or None, foreach=False)
    return param.nbytes / _median_s(opt.step)


def _median_s(run: Callable[[], object], rounds: int = 3) -> float:
    times = sorted(_times_s(run, rounds))
    return max(times[len(times) // 2], 1e-9)


def _collectives(group: dist.ProcessGroup | None) -> tuple[dict[str, float], dict[str, float]]:
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    if world == 1:
        return dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, float("inf"))
    # On gloo phalanx's reduce-scatter is an all-reduce (its block copied out, a copy the
    # step prices apart): priced as one. Timed apart, the same call read 2.2x faster than
    # the all-reduce in one probe, and the planner chose stage 2 for a speed it lacks.
    gloo = is_gloo(group)
    latency, rate = {}, {}
    for kind in kinds[:2] if gloo else kinds:
        small, large = (_time_collective(kind, n, world, group) for n in (_SMALL, _LARGE))
        slope = max((large - small) / (_LARGE - _SMALL), 1e-15)
        rate[kind] = 1.0 / slope
        latency[kind] = max(0.0, small - _SMALL * slope)
    if gloo:
        latency["reduce_scatter"] = latency["all_reduce"]
        rate["reduce_scatter"] = rate["all_reduce"]
    return latency, rate


def _busy_all_reduce(group: dist.ProcessGroup | None) -> float:
    """Bytes per second of a 16 MB all-reduce with this rank copying 1 MB pieces until it
    ends, the slowest of seven (inf alone: nothing to reduce). The slowest: a backward's
    reductions run beside it for its whole length, as the slowest rounds do (the copy and
    gloo's thread on one core), where a lucky round has a core to itself. Over five probes
    of one machine the slowest read 466-530 MB/s and the median 593-876."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return float("inf")
    whole, piece = torch.ones(_LARGE // 4), torch.ones(1 << 18)
    rates = []
    for _ in range(7):
        dist.barrier(group=group)
        start = time.perf_counter()
        work = dist.all_reduce(whole, group=group, async_op=True)
        assert work is not None
        while not work.is_completed():
            torch.empty_like(piece).copy_(piece)
        work.wait()
        rates.append(_LARGE / max(time.perf_counter() - start, 1e-9))
    return min(rates)


def _time_collective(kind: str, nbytes: int, world: int, group: dist.ProcessGroup | None) -> float:
    part = torch.ones(nbytes // 4 // world)
    whole = torch.ones(part.numel() * world)
    calls: dict[str, Callable[[], object]] = {  # as ZeRO issues them (on gloo: broadcasts)
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "all_gather": lambda: wait_all_gather(start_all_gather(whole, part, group)),
        "reduce_scatter": lambda: wait_reduce_scatter(
            start_reduce_scatter(part, whole, group), group
        ),
    }

    def together() -> None:
        dist.barrier(group=group)
        calls[kind]()

    return _best_s(together)


def _disk(directory: str) -> tuple[float, float]:
    """(read, write) bytes per second of a file in `directory`, every rank at once."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(prefix="phalanx-plan-probe-", dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(_DISK_BYTES >> 20):
            os.write(fd, block)
        os.fdatasync(fd)
        write = _DISK_BYTES / (time.perf_counter() - start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, 1 << 20):
            pass
        read = _DISK_BYTES / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return read, write


def disk_direct_rates(directory: str) -> tuple[float, float] | None:
    """(read, write) bytes per second by O_DIRECT, every rank at once, the way a disk
    offload moves its optimizer state (offload/direct.py: 1 MB pieces, LANES in flight);
    None where the filesystem refuses O_DIRECT (the offload then maps its state)."""
    from phalanx.offload.direct import (
        LANES,
        DirectEntry,
        DirectWindow,
        Slab,
        StatePlace,
        supported,
    )

    if not supported(Path(directory)):
        return None
    fd, name = tempfile.mkstemp(prefix="phalanx-plan-probe-", dir=directory)
    try:
        os.ftruncate(fd, _DISK_BYTES)
        os.close(fd)
        entry = DirectEntry(StatePlace({}, "probe"), torch.empty(0), Path(name), 0, _DISK_BYTES)
        window = DirectWindow([entry], Slab(_DISK_BYTES))
        with ThreadPoolExecutor(LANES, thread_name_prefix="phalanx-plan-probe") as lanes:
            start = time.perf_counter()
            window.write(os.open, lanes)
            write = _DISK_BYTES / (time.perf_counter() - start)
            start = time.perf_counter()
            window.read(os.open, lanes)
            read = _DISK_BYTES / (time.perf_counter() - start)
    finally:
        os.unlink(name)
    return read, write


def measure_rates(group: dist.ProcessGroup | None, offload_dir: str | None) -> Rates:
    """Collective over `group` (every rank calls it): this machine's rates, the slowest
    rank's figure of each, the largest libraries (see the module doc). Measured as a
    planned run steps: returning freed memory to the kernel (auto.py), whose page faults
    on every temporary made torch's per-tensor AdamW 2.5x slower than a probe without."""
    return_freed_memory()
    _warm_up()
    libraries = resident_bytes()
    latency, rate = _collectives(group)
    busy = _busy_all_reduce(group)

    def together(measure: Callable[[], _T]) -> _T:
        """Every rank measures at once, as they train at once (they share the memory's
        bandwidth, the cores and the disk)."""
        if dist.is_initialized():
            dist.barrier(group=group)
        return measure()

    read, write = direct_read, direct_write = (float("inf"), float("inf"))
    if offload_dir:
        read, write = together(lambda: _disk(offload_dir))
        direct = together(lambda: disk_direct_rates(offload_dir))
        direct_read, direct_write = direct or (read, write)  # refused: the state is mapped

    mine = {
        "flops_per_s": together(_flops_per_s),
        "memory_bytes_per_s": together(_memory_bytes_per_s),
        "fresh_copy_bytes_per_s": together(_fresh_copy_bytes_per_s),
        "adam_fused_bytes_per_s": together(lambda: _adam_bytes_per_s(fused=True)),
        "adam_loop_bytes_per_s": together(lambda: _adam_bytes_per_s(fused=False)),
        "disk_read_bytes_per_s": read,
        "disk_write_bytes_per_s": write,
        "disk_direct_read_bytes_per_s": direct_read,
        "disk_direct_write_bytes_per_s": direct_write,
        "busy_all_reduce_bytes_per_s": busy,
        "libraries_bytes": libraries,
    }
    everyone = all_gather_json([mine, latency, rate], group) if dist.is_initialized() else []
    if everyone:  # every rank plans from the same figures: the worst of each
        worst_rate = {k: min(r[2][k] for r in everyone) for k in rate}
        worst_latency = {k: max(r[1][k] for r in everyone) for k in latency}
        worst = {k: min(r[0][k] for r in everyone) for k in mine}
        worst["libraries_bytes"] = max(r[0]["libraries_bytes"] for r in everyone)
        mine, latency, rate = worst, worst_latency, worst_rate
    return Rates(collective_latency_s=latency, collective_bytes_per_s=rate, **mine)
