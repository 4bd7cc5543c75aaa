"""Fractional disk offload at stage 3: step time and peak RSS against the fraction in files.

Variants (world 2, `fully_shard` on each Linear then the root, AdamW at lr 1e-3,
16 MB windows: the windows in flight must be small beside the state, or they, not the
fraction, set the peak):

| variant         | what it is                                                          |
|-----------------|---------------------------------------------------------------------|
| `memory`        | no offload: the reference for parity                                |
| `f0` ... `f1`   | `DiskOffloadPolicy(fraction=f)`, order "coldest" (the state first)  |
| `f0.5-largest`  | fraction 1/2, order "largest": whole parameters, largest first      |

Memory: each variant in a fresh pair of processes, 4 steps; per rank the peak
RSS (`ru_maxrss`), and the bytes of shards, gradients and state in memory and in
files, counted from the tensors. Time: every variant in one pair of processes,
taking turns step by step in a balanced order (interleave.py), on the same
batches; a step's time is the slower rank's; medians. Parity: each variant's
parameters after the timed rounds against `memory`'s (the same batches, the
same number of steps). The run is monotone if the step time does not fall and
the peak RSS does not rise as the fraction grows (the step time as the median
of each round's ratio to the in-memory step, which shares that round's load;
within `--slack`).

    python benchmarks/offload_fraction.py            # ~6 minutes on 2 cores
    python benchmarks/offload_fraction.py --tiny     # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import interleave
import spawn
import torch
from torch import nn

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "offload_fraction.json"
MB = 2**20
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
VARIANTS = ("memory", *(f"f{f:g}" for f in FRACTIONS), "f0.5-largest")


def shape(tiny: bool) -> tuple[int, int, int]:
    """(layers, width, batch per rank)."""
    return (3, 64, 8) if tiny else (8, 2048, 128)


def build(variant: str, tiny: bool, scratch: str) -> tuple[nn.Module, Any, Any]:
    import phalanx
    from phalanx import zero3
    from phalanx.offload import DiskOffloadPolicy
    from phalanx.offload.fraction import Order

    layers, width, _ = shape(tiny)
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*body[:-1])
    policy = None
    if variant != "memory":
        fraction = float(variant[1:].split("-")[0])
        order: Order = "largest" if variant.endswith("largest") else "coldest"
        policy = DiskOffloadPolicy(path=scratch, window_mb=16, fraction=fraction, order=order)
    zero3.shard_model(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if policy is not None:
        phalanx.offload_optimizer(opt, policy)
    return model, opt, policy


def batch(g: torch.Generator, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _, width, rows = shape(tiny)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def step(model: nn.Module, opt: Any, xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    nn.functional.mse_loss(model(xy[0]), xy[1]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def placement_mb(model: nn.Module, opt: Any, policy: Any) -> dict[str, float]:
    """Bytes of shards, gradient shards and state, in memory and in files (this rank)."""
    from phalanx import zero3

    files = policy.files() if policy is not None else None
    out = {"memory_mb": 0.0, "files_mb": 0.0}
    tensors = [sp.local for u in zero3.units(model) for sp in u.params]
    tensors += [
        sp.grad_home for u in zero3.units(model) for sp in u.params if sp.grad_home is not None
    ]
    tensors += [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        where = "files_mb" if files is not None and files.holds(t) else "memory_mb"
        out[where] += t.nbytes / MB
    return out


def measure_rank(rank: int, world: int, variant: str, tiny: bool, scratch: str) -> dict[str, Any]:
    from phalanx.runtime.hostmem import return_freed_memory

    return_freed_memory()
    model, opt, policy = build(variant, tiny, scratch)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        step(model, opt, batch(g, tiny))
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out.update(placement_mb(model, opt, policy))
    if policy is not None:
        policy.close()
    return out


def time_rank(rank: int, world: int, rounds: int, tiny: bool, scratch: str) -> dict[str, Any]:
    import torch.distributed as dist

    from phalanx import zero3

    built = {v: build(v, tiny, scratch) for v in VARIANTS}
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rounds = interleave.balanced_rounds(rounds, rounds, len(VARIANTS))
    for r in range(rounds + 1):  # round 0 warms up (the state is made, files allocated)
        xy = batch(g, tiny)
        for variant in interleave.balanced_order(r, VARIANTS):
            model, opt, _ = built[variant]
            dist.barrier()
            start = time.perf_counter()
            step(model, opt, xy)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            if r:
                times[variant].append(float(elapsed))
    full = {v: zero3.full_state_dict(built[v][0], to=0) for v in VARIANTS}
    gap: dict[str, float] = {}
    if rank == 0:
        ref = full["memory"]
        assert ref is not None
        for v in VARIANTS:
            mine = full[v]
            assert mine is not None
            gap[v] = max((mine[k] - ref[k]).abs().max().item() for k in ref)
    for _, _, policy in built.values():
        if policy is not None:
            policy.close()
    return {"times": times, "parity": gap}


def monotone(values: list[float], rising: bool, slack: float) -> bool:
    """Whether `values` never move against the direction by more than `slack` (relative)."""
    for a, b in itertools.pairwise(values):
        if rising and b < a * (1 - slack):
            return False
        if not rising and b > a * (1 + slack):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--slack", type=float, default=0.03)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="phalanx-fraction-")
    memory = {v: spawn.run_ranks(measure_rank, 2, v, args.tiny, scratch) for v in VARIANTS}
    timing = spawn.run_ranks(time_rank, 2, args.rounds, args.tiny, scratch)[0]
    medians = {v: statistics.median(timing["times"][v]) for v in VARIANTS}
    # Each round's ratio to the in-memory step of the same round: the machine's load drifts
    # from round to round, and both steps of a round share it.
    by_round = {
        v: statistics.median(a / b for a, b in zip(timing["times"][v], timing["times"]["memory"]))
        for v in VARIANTS
    }
    rss = {v: max(r["peak_rss_mb"] for r in memory[v]) for v in VARIANTS}
    fractions = [f"f{f:g}" for f in FRACTIONS]
    layers, width, rows = shape(args.tiny)
    result = {
        "model": {"layers": layers, "width": width, "batch_per_rank": rows, "world": 2},
        "memory": memory,
        "step_s": timing["times"],
        "step_s_median": medians,
        "over_memory_by_round": by_round,
        "peak_rss_mb": rss,
        "parity": timing["parity"],
        "monotone_time": monotone([by_round[v] for v in fractions], True, args.slack),
        "monotone_rss": monotone([rss[v] for v in fractions], False, args.slack),
        "slack": args.slack,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown_table(result), flush=True)
    return 0


def markdown_table(result: dict[str, Any]) -> str:
    lines = [
        "| variant | in memory MB | in files MB | peak RSS MB (max rank) | step ms (median) "
        "| ÷ memory: medians; median of the rounds' | parity (max abs) |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    med = result["step_s_median"]
    for v in VARIANTS:
        r0 = result["memory"][v][0]
        lines.append(
            f"| {v} | {r0['memory_mb']:.0f} | {r0['files_mb']:.0f} | "
            f"{result['peak_rss_mb'][v]:.0f} | {med[v] * 1e3:.0f} | "
            f"{med[v] / med['memory']:.2f}; {result['over_memory_by_round'][v]:.2f} | "
            f"{result['parity'][v]:.1e} |"
        )
    lines.append(
        f"monotone: step time {result['monotone_time']}, peak RSS {result['monotone_rss']} "
        f"(slack {result['slack']:.0%})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
