"""Is gloo's own reduce-scatter worth using for ZeRO-2 and stage 3? Measured against phalanx's
choice on gloo: an all-reduce of the whole buffer, then this rank's block copied out.

Each world size runs its own processes; the two collectives take turns (A B A B ...) over
the same buffer sizes, and each figure is the median of the rounds. Both give the same
bits (checked here). Results: docs/results/gloo_reduce_scatter.json.

    python benchmarks/gloo_reduce_scatter.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SIZES_MB = (1, 16, 64)
ROUNDS = 7


def _bench(rank: int, world: int, port: int, results: dict[str, object]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one thread per rank: the ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 4 // world * world
        x, out = torch.randn(n), torch.empty(n // world)
        times: dict[str, list[float]] = {"all_reduce+copy": [], "reduce_scatter": []}

        block = slice(rank * (n // world), (rank + 1) * (n // world))

        def all_reduce_copy(
            x: torch.Tensor = x, out: torch.Tensor = out, block: slice = block
        ) -> None:
            dist.all_reduce(x)
            out.copy_(x[block])

        def reduce_scatter(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            dist.reduce_scatter_tensor(out, x)

        ops = {"all_reduce+copy": all_reduce_copy, "reduce_scatter": reduce_scatter}
        for _ in range(ROUNDS):
            for name, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        a = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        b, got = a.clone(), torch.empty(n // world)
        dist.all_reduce(a)
        dist.reduce_scatter_tensor(got, b)
        same = torch.equal(got, a[rank * (n // world) : (rank + 1) * (n // world)])
        medians = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"mb": mb, "ms": {k: round(v * 1e3, 2) for k, v in medians.items()},
                     "reduce_scatter_over_ours": round(medians["reduce_scatter"]
                                                       / medians["all_reduce+copy"], 3),
                     "same_bits": same})  # fmt: skip
    if rank == 0:
        results[str(world)] = rows
    dist.destroy_process_group()


def main() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from phalanx.ground.ports import free_port

    manager = mp.Manager()
    results = manager.dict()
    for world in (2, 3):
        mp.spawn(_bench, args=(world, free_port(), results), nprocs=world)
    figures = {"settings": {"sizes_mb": SIZES_MB, "rounds": ROUNDS, "threads_per_rank": 1,
                            "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
               "worlds": dict(results)}  # fmt: skip
    out = ROOT / "docs" / "results" / "gloo_reduce_scatter.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    for world, rows in figures["worlds"].items():
        for row in rows:
            print(f"world {world} {row['mb']:3d} MB: {row['ms']}  reduce_scatter / ours = "
                  f"{row['reduce_scatter_over_ours']}  same bits: {row['same_bits']}")  # fmt: skip


if __name__ == "__main__":
    main()
