"""The choices under a background save, measured in one process (run by async_save.py).

Staging: how the state is set aside at the step boundary, so the next step can
change it while the old values are written.

- `copy`: phalanx's (train/checkpoint/staging.py): a host copy into fresh memory;
- `reused`: the same copy into buffers kept from an earlier save (what DCP's
  cached staging does): no page faults, but the memory is held between saves;
- `fork`: a copy-on-write fork (Redis' BGSAVE): the child holds the old pages
  and writes them; the parent's next step faults a copy of every page it
  changes, so the cost moves into that step.

For each: the loop's stall (the copy, or the fork call), and the next step's
time (`--state-mb` of state updated in place, as an optimizer step does)
against that step with nothing set aside.

Writer: a thread against a process (the forked child), writing the set-aside
state with torch.save + fsync while the main thread computes steps (matmuls):
the main thread's step time while writing against quiet. The thread twice: at
the training thread's priority, and niced (phalanx's, background.py: the
kernel runs it when training leaves a core idle).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from interleave import balanced_order

_TENSORS = 24
NICE = 10


def _state(mb: int) -> dict[str, torch.Tensor]:
    numel = mb * 2**20 // 4 // _TENSORS
    return {f"t{i}": torch.randn(numel) for i in range(_TENSORS)}


def _update(state: dict[str, torch.Tensor]) -> float:
    """An optimizer-like step: every element changed in place; its seconds."""
    start = time.perf_counter()
    for tensor in state.values():
        tensor.mul_(0.999).add_(1e-3)
    return time.perf_counter() - start


def _write(state: dict[str, Any], where: Path) -> None:
    from phalanx.train.checkpoint.directory import write_file

    write_file(where, "state.pt", state)


def _stage_once(
    kind: str, state: dict[str, torch.Tensor], reused: dict[str, Any]
) -> dict[str, Any]:
    from phalanx.train.checkpoint.staging import stage

    start = time.perf_counter()
    child = 0
    if kind == "copy":
        stage(state)
    elif kind == "reused":
        for name, tensor in state.items():
            reused[name].copy_(tensor)
    else:
        child = os.fork()
        if child == 0:  # the child only holds the old pages, then leaves
            time.sleep(5)
            os._exit(0)
    stall = time.perf_counter() - start
    step = _update(state)
    if child:
        os.kill(child, 9)
        os.waitpid(child, 0)
    return {"stall_s": stall, "next_step_s": step}


def _steps_while(write: Any, matrix: torch.Tensor) -> tuple[list[float], float]:
    """Main-thread matmul steps while `write()` runs elsewhere; their times, and the write's."""
    done = threading.Event()
    times: list[float] = []
    started = time.perf_counter()

    def run() -> None:
        write()
        done.set()

    watcher = threading.Thread(target=run, daemon=True)
    watcher.start()
    while not done.is_set():
        step = time.perf_counter()
        matrix @ matrix
        times.append(time.perf_counter() - step)
    watcher.join()
    return times, time.perf_counter() - started


def _writer_once(kind: str, state: dict[str, torch.Tensor], root: Path) -> dict[str, Any]:
    from phalanx.train.checkpoint.staging import stage

    matrix = torch.randn(768, 768)
    quiet = [_timed(lambda: matrix @ matrix) for _ in range(20)]
    where = Path(tempfile.mkdtemp(dir=root))
    if kind.startswith("thread"):
        copy, _ = stage(state)
        nice = 0 if kind == "thread" else NICE

        def niced() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            _write(copy, where)

        times, written = _steps_while(niced, matrix)
    else:

        def in_child() -> None:
            child = os.fork()
            if child == 0:
                try:
                    _write(state, where)
                finally:
                    os._exit(0)
            os.waitpid(child, 0)

        times, written = _steps_while(in_child, matrix)
    return {
        "step_ratio": statistics.median(times) / statistics.median(quiet),
        "longest_step_ms": 1e3 * max(times),
        "written_s": written,
    }


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(mb: int, rounds: int) -> dict[str, Any]:
    """Both comparisons, interleaved over `rounds` rounds: medians per variant."""
    torch.set_num_threads(1)
    state = _state(mb)
    reused = {name: torch.empty_like(t) for name, t in state.items()}
    baseline = [_update(state) for _ in range(3)]
    staging: dict[str, list[dict[str, Any]]] = {"copy": [], "reused": [], "fork": []}
    writers: dict[str, list[dict[str, Any]]] = {"thread": [], "thread_nice": [], "process": []}
    with tempfile.TemporaryDirectory(prefix="async-staging-") as root:
        for r in range(rounds):
            for kind in balanced_order(r, list(staging)):
                staging[kind].append(_stage_once(kind, state, reused))
            for kind in balanced_order(r, list(writers)):
                writers[kind].append(_writer_once(kind, state, Path(root)))
    step = statistics.median(baseline)
    out: dict[str, Any] = {"state_mb": mb, "step_alone_s": step}
    for kind, runs in staging.items():
        stall = statistics.median(r["stall_s"] for r in runs)
        next_step = statistics.median(r["next_step_s"] for r in runs)
        out[kind] = {
            "stall_s": stall,
            "next_step_s": next_step,
            "next_step_ratio": next_step / step,
        }
    for kind, runs in writers.items():
        out[f"writer_{kind}"] = {
            key: statistics.median(r[key] for r in runs)
            for key in ("step_ratio", "longest_step_ms", "written_s")
        }
    return out
