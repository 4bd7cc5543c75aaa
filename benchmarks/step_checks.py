"""What the Trainer's per-step safety checks cost, as a share of a training step.

- The non-finite check (on_nonfinite_grad, on by default): with clipping
  (max_grad_norm > 0, the default) the global norm exists already and the
  check reads one scalar; without clipping it computes that norm first.
- The replica check (replica_check_steps, off by default): each rank
  fingerprints every parameter and buffer (sum and sum of squares in
  float64), then one small all-gather.
- The two small all-reduces each step adds at world > 1: the step's sample
  count (micro-batch loss weights) and the stop vote (save on SIGTERM/SIGINT).

Each is measured apart from the step (timing two whole steps and subtracting
would drown a few microseconds in milliseconds of noise), interleaved with
whole steps (forward, backward, clip, AdamW, zero_grad) of the benchmark
models, in CPU time with one thread, medians over rounds. The all-reduces
are timed on 2 gloo ranks on this machine.

    python benchmarks/step_checks.py [--models mlp,gpt,cnn] [--rounds 7]   # a few minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import models
import torch
import torch.distributed as dist
from spawn import run_ranks

from phalanx.diagnostics.replicas import fingerprints

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_checks.json"


def _cpu_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.process_time_ns()
    for _ in range(calls):
        fn()
    return (time.process_time_ns() - start) / calls / 1e6


def measure_model(name: str, rounds: int, steps: int, tiny: bool) -> dict[str, float]:
    spec = models.SPECS[name](tiny)
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = spec.make_batch(torch.Generator().manual_seed(0))
    params = list(model.parameters())
    tensors = [*params, *model.buffers()]

    def backward() -> None:
        spec.loss(model(inputs), targets).backward()

    def step() -> None:
        backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    backward()  # gradients for the checks to read
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    checks: dict[str, Callable[[], object]] = {
        "step": step,
        "check_clipped": lambda: bool(torch.isfinite(norm)),
        "check_unclipped": lambda: bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))),
        "fingerprint": lambda: fingerprints(tensors),
    }
    samples: dict[str, list[float]] = {key: [] for key in checks}
    for _ in range(2):
        step()
    for r in range(rounds):
        order = list(checks) if r % 2 == 0 else list(reversed(checks))
        for key in order:
            calls = steps if key == "step" else steps * 4
            samples[key].append(_cpu_ms(checks[key], calls))
    out = {f"{key}_ms": statistics.median(values) for key, values in samples.items()}
    out["tensors"] = float(len(tensors))
    out["parameters_m"] = sum(p.numel() for p in params) / 1e6
    return out


def _small_all_reduce(rank: int, world: int, calls: int) -> float:
    """Median wall ms of one all-reduce of 3 float64, as the Trainer's per-step ones."""
    tensor = torch.zeros(3, dtype=torch.float64)
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter_ns()
        dist.all_reduce(tensor)
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt,cnn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for name in opts.models.split(","):
        results[name] = measure_model(name, opts.rounds, opts.steps, opts.tiny)
    results["small_all_reduce_ms_world2"] = statistics.median(
        run_ranks(_small_all_reduce, 2, 20 if opts.tiny else 200)
    )
    print(_table(results))
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1))
    return 0


def _table(results: dict[str, object]) -> str:
    reduce_ms = float(results["small_all_reduce_ms_world2"])  # type: ignore[arg-type]
    lines = [
        "| model | step (ms) | NaN check, clipping (% of step) | NaN check, no clipping (%) "
        "| replica fingerprint (ms, % of one step) | 2 small all-reduces at world 2 (%) |",
        "|---|---|---|---|---|---|",
    ]
    for name, value in results.items():
        if not isinstance(value, dict):
            continue
        step = value["step_ms"]
        lines.append(
            f"| {name} | {step:.1f} | {100 * value['check_clipped_ms'] / step:.3f} "
            f"| {100 * value['check_unclipped_ms'] / step:.2f} "
            f"| {value['fingerprint_ms']:.2f} ({100 * value['fingerprint_ms'] / step:.1f}) "
            f"| {100 * 2 * reduce_ms / step:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
