"""What the progress record costs: per call, and per DDP step of the 261-tensor GPT model.

Every rank records where it stands (`phalanx.ground.progress_record`): the reducer
calls `collective()` once per bucket it launches, the Trainer `step()` once per
optimizer step. Each call is a few stores into a memory-mapped file. This
measures, in one process (a world of one, the same tiny batch as hook_path.py):

- the CPU time of one `collective()` and one `step()` call, file-backed as under
  `phalanx launch`, minus the cost of calling an empty function;
- a whole DDP step with the record armed and disarmed, interleaved in rounds,
  medians of CPU time per step, and the difference as a share of the step.

    python benchmarks/progress_record.py            # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import models
import torch
import torch.distributed as dist
from hook_path import make_step, tiny_batch

from phalanx.ground import progress_record as progress

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "progress_record.json"


def _per_call_ns(fn: Callable[[], None], calls: int, rounds: int) -> float:
    """Median over rounds of the CPU time per call."""
    samples = []
    for _ in range(rounds):
        start = time.process_time_ns()
        for _ in range(calls):
            fn()
        samples.append((time.process_time_ns() - start) / calls)
    return statistics.median(samples)


def per_call(calls: int, rounds: int) -> dict[str, float]:
    def empty() -> None:
        pass

    base = _per_call_ns(empty, calls, rounds)
    coll = _per_call_ns(lambda: progress.collective("ddp all_reduce bucket", 3, 7), calls, rounds)
    step = _per_call_ns(lambda: progress.step(12), calls, rounds)
    return {"collective_ns": coll - base, "step_ns": step - base}


def per_step(steps: int, rounds: int, warmup: int) -> dict[str, float]:
    from phalanx import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(models.gpt_spec(tiny=False).build())
    step = make_step(model, tiny_batch(vocab=512))
    armed = progress._recorder
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(warmup):
        step()
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            progress._recorder = armed if on else None
            for _ in range(per_round):
                start = time.process_time_ns()
                step()
                cpu[on].append((time.process_time_ns() - start) / 1e3)
    progress._recorder = armed
    with_us, without_us = statistics.median(cpu[True]), statistics.median(cpu[False])
    return {
        "buckets": len(model.reducer.buckets),
        "step_with_record_us": with_us,
        "step_without_record_us": without_us,
        "share_of_step": (with_us - without_us) / without_us,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    parser.add_argument("--steps", type=int, default=1000, help="timed DDP steps per variant")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ[progress.PROGRESS_DIR_VAR] = tempfile.mkdtemp(prefix="phalanx-bench-")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    progress.start(0, 1, 1800.0)  # what phalanx.init() does; the group above is plain torch's
    try:
        result = {**per_call(args.calls, args.rounds),
                  **per_step(args.steps, args.rounds, args.warmup)}  # fmt: skip
    finally:
        dist.destroy_process_group()
    print(
        f"progress record: collective() {result['collective_ns']:.0f} ns, step() "
        f"{result['step_ns']:.0f} ns per call; gpt DDP step ({result['buckets']} buckets) "
        f"{result['step_without_record_us']:.0f} us without, {result['step_with_record_us']:.0f}"
        f" us with the record ({100 * result['share_of_step']:+.2f}%, CPU medians)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
