"""Run a function on N real processes joined by a gloo process group.

Every test that needs ranks goes through `run_workers`: it spawns fresh
interpreters, gives each one a rank, and enforces a hard deadline so a
deadlock fails the test in seconds instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from phalanx.ground.ports import free_port


@dataclass
class Outcome:
    """What one rank ended with: a value, or the error it raised."""

    rank: int
    exitcode: int | None
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None


class WorkersFailed(AssertionError):
    """Some rank raised, died, or the group ran past its deadline."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    init_pg: bool,
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    # One thread per rank: the ranks share two cores, and oversubscription makes
    # gloo's progress threads starve and tests crawl.
    torch.set_num_threads(1)
    code = 0
    try:
        if init_pg:
            _join_group(rank, world_size, port)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value, None, None))
    except BaseException as exc:  # report every failure, including SystemExit
        code = 1
        results.put((rank, "error", type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        # Flush the queue's feeder thread: os._exit would drop a result still in flight.
        results.close()
        results.join_thread()
    os._exit(code)


def _join_group(rank: int, world_size: int, port: int) -> None:
    """The gloo group, up on every rank when this returns on any.

    gloo connects the ranks pairwise while the group is built, and one rank's side
    can be done before another's: a rank that then left at once (a test whose rank 1
    has nothing to do) closed its sockets under a peer still connecting, whose
    init_process_group failed with "Connection closed by peer" (1 run in about 12 on
    a loaded machine). So every rank announces that its group is built and waits for
    all; the store pushes the wake-up, which is sent before the last rank can leave.
    """
    import torch.distributed as dist

    wait = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait)
    if store.add("harness/groups_built", 1) == world_size:
        store.set("harness/every_group_built", "1")
    store.wait(["harness/every_group_built"])


def _context() -> Any:
    """Fork ranks from a server that has imported torch once: a fresh interpreter per rank
    would import it again (about 3 s for two ranks on two cores, for every test). The
    server is a clean process (no threads, no process group), so each fork starts clean."""
    ctx = mp.get_context("forkserver")
    # What the test modules import, so a rank unpickling its function imports little more;
    # torch.distributed.checkpoint (ZeRO's sharded state) alone costs seconds per process.
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch.distributed.checkpoint",
            "phalanx",
            "phalanx.train",
            "phalanx.zero3",
            "phalanx.optim",
            "tests.harness",
        ]
    )
    return ctx


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    init_pg: bool = True,
    allow_errors: bool = False,
) -> list[Outcome]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks.

    `fn` must be importable (module level). With `allow_errors=False`, any rank
    failing raises `WorkersFailed` with every rank's traceback; otherwise the
    outcomes are returned for the test to inspect.
    """
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(_PORT_ATTEMPTS):
        outcomes, procs, port_taken = _attempt(fn, world_size, args, timeout, env, init_pg)
        if not port_taken or attempt == _PORT_ATTEMPTS - 1:
            break
    for rank, p in enumerate(procs):
        outcomes.setdefault(rank, Outcome(rank, None, error_type="NoResult"))
        outcomes[rank].exitcode = p.exitcode
    ordered = [outcomes[r] for r in range(world_size)]
    timed_out = any(o.error_type == "NoResult" for o in ordered)
    if timed_out or (not allow_errors and any(o.error_type for o in ordered)):
        report = "\n".join(
            f"--- rank {o.rank} exit={o.exitcode} {o.error_type}: {o.error}\n{o.traceback or ''}"
            for o in ordered
        )
        what = f"timed out after {timeout:.0f}s (deadlock?)" if timed_out else "failed"
        raise WorkersFailed(f"workers {what}:\n{report}")
    return ordered


_PORT_ATTEMPTS = 3
"""A free port is free only until someone binds it: another test's process, started at the
same moment by another pytest worker, may take the store's port first (EADDRINUSE on rank
0). Such a start is made again on a new port, not failed."""


def _attempt(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    env: dict[str, str],
    init_pg: bool,
) -> tuple[dict[int, Outcome], list[Any], bool]:
    """One start of the ranks: their outcomes, their processes, and whether rank 0 found its
    store's port taken (then the others are stopped at once)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, env, init_pg, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    port_taken = False
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, a, b, c = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            if status == "ok":
                outcomes[rank] = Outcome(rank, None, value=a)
                continue
            outcomes[rank] = Outcome(rank, None, error_type=a, error=b, traceback=c)
            if init_pg and a == "DistNetworkError" and "EADDRINUSE" in str(b):
                port_taken = True
                break
        if not port_taken:
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return outcomes, procs, port_taken


def run_scenarios(scenarios: Mapping[str, Callable[[], Any]], rank: int) -> dict[str, Any]:
    """Run each scenario in this rank, in order; one that raises is recorded, not fatal.

    So one bug does not hide the results of the others (unless it desyncs the
    ranks). Progress goes to stderr, which a timed-out test shows.
    """
    results: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        print(f"[rank {rank}] scenario {name}", file=sys.stderr, flush=True)
        try:
            results[name] = scenario()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def world_sizes(*sizes: int) -> list[Any]:
    """Parameters over world sizes: 1 and 2 run in `make test`, larger ones in `make
    test-slow` (a third rank on two cores doubles a spawn's time; world 2 is the one torch
    parity is promised at)."""
    return [size if size <= 2 else pytest.param(size, marks=pytest.mark.slow) for size in sizes]
