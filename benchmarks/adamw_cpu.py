"""torch's AdamW on the CPU, three ways, on shard-sized tensors: which should an offloaded step run?

Variants, interleaved round by round in a balanced order (interleave.py):

| variant   | what it is                                                        |
|-----------|-------------------------------------------------------------------|
| `single`  | AdamW(foreach=False): a loop of per-tensor ops (torch's CPU default) |
| `foreach` | AdamW(foreach=True): each op over the list of tensors at once      |
| `fused`   | AdamW(fused=True): one CPU kernel per tensor, every op in one pass |

Each steps the same tensors (a window of stage-3 shards: `--tensors` matrices of
`--numel` floats plus as many small bias shards) from the same values with the
same gradients, weight decay on. Plain tensors, and DTensors on a world of one
(what stage 3's AdamW steps). Reported: the median step per variant, ratios to
`single`, and each variant's largest difference from `single` after the steps.

    python benchmarks/adamw_cpu.py                 # ~1 minute
    python benchmarks/adamw_cpu.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import interleave

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "adamw_cpu.json"
VARIANTS = ("single", "foreach", "fused")
OPTIONS: dict[str, dict[str, Any]] = {
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def make_params(args: argparse.Namespace, dtensor: bool) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    shapes = [(args.numel,)] * args.tensors + [(args.numel // 1024,)] * args.tensors
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(*shape, generator=gen))
        p.grad = torch.randn(*shape, generator=gen) * 1e-2
        params.append(p)
    if not dtensor:
        return params
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    out = []
    for p in params:
        d = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        assert p.grad is not None  # make_params gave every parameter one
        d.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        out.append(d)
    return out


def run(args: argparse.Namespace, dtensor: bool) -> dict[str, Any]:
    import torch

    sets = {v: make_params(args, dtensor) for v in VARIANTS}
    opts = {
        v: torch.optim.AdamW(sets[v], lr=1e-3, weight_decay=0.01, **OPTIONS[v]) for v in VARIANTS
    }
    for v in VARIANTS:
        opts[v].step()  # untimed: makes the state
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rounds = interleave.balanced_rounds(args.rounds, args.rounds, len(VARIANTS))
    for r in range(rounds):
        for v in interleave.balanced_order(r, VARIANTS):
            for _ in range(args.per_round):
                start = time.perf_counter()
                opts[v].step()
                times[v].append(time.perf_counter() - start)
    steps = 1 + len(times["single"])
    ref = sets["single"]
    diff = {
        v: max(float((a - b).abs().max()) for a, b in zip(sets[v], ref, strict=True))
        for v in VARIANTS
    }
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    nbytes = sum(p.numel() for p in ref) * 4
    return {
        "median_ms": {v: med[v] * 1e3 for v in VARIANTS},
        "over_single": {v: med[v] / med["single"] for v in VARIANTS},
        "gb_s_of_params": {v: nbytes / med[v] / 1e9 for v in VARIANTS},
        "max_abs_diff_from_single": diff,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--numel", type=int, default=2048 * 1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1
    )  # DTensors need a mesh: a world of one
    report = {
        "config": {**vars(args), "out": str(args.out), "torch": torch.__version__},
        "tensor": run(args, dtensor=False),
        "dtensor": run(args, dtensor=True),
    }
    dist.destroy_process_group()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
