"""Run a function on N fresh gloo ranks and collect what each returns (for benchmarks).

Fresh interpreters, not forks: a benchmark that reports peak RSS per rank must
not inherit a parent's memory. The thread count is set before the ranks import
torch, because N ranks share this machine's cores.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from phalanx.ground.ports import free_port


def _die_with_parent() -> None:
    """A rank whose benchmark was killed must not go on computing alone (Linux only).

    `run_ranks` kills its ranks when it ends, but nothing runs in a parent that
    was SIGKILLed or stopped by a signal it does not handle: the kernel's
    parent-death signal does it then.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call: nobody would signal us
        os._exit(1)


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    _die_with_parent()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=600),
        )
        out.put(("ok", rank, fn(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, threads: int = 1, timeout: float = 1800.0
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` spawned ranks; their return values by rank."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, args, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world:
            if time.monotonic() > deadline:
                raise SystemExit(f"ranks ran past {timeout:.0f}s — one hung?")
            try:
                kind, rank, payload = out.get(timeout=1.0)
            except queue.Empty:
                # A rank that reported may have exited already; one that did not, died.
                silent = [r for r, p in enumerate(procs) if not p.is_alive() and r not in values]
                if silent and out.empty():
                    raise SystemExit(
                        f"rank {silent[0]} died without reporting — see its output"
                    ) from None
                continue
            if kind == "error":
                raise SystemExit(f"rank {rank} failed:\n{payload}")
            values[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [values[r] for r in range(world)]
