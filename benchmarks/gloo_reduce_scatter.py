"""Which reduce-scatter ZeRO-2 and stage 3 should use on gloo, measured.

Three ways to leave each rank the sum of its block of everyone's buffer:
- `all_reduce+copy`: an all-reduce of the whole buffer, then this rank's block copied out
  (what phalanx.parallel.collectives issues on gloo);
- `gloo_reduce_scatter`: gloo's own `reduce_scatter_tensor`;
- `exchange` (2 ranks only): each rank sends the other its block, an all-to-all that
  sends nothing to itself, and adds its own block to what it receives: half the bytes.

Each world size runs its own processes; the ways take turns (A B C A B C ...) over the
same buffer sizes, and each figure is the median of the rounds. Whether each gives the
same bits as gloo's reduce-scatter is checked in fp32 and bf16, on every rank.
Results: docs/results/gloo_reduce_scatter.json. Why phalanx keeps the all-reduce although
the exchange is faster here: docs/zero.md, "The collectives".

    python benchmarks/gloo_reduce_scatter.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SIZES_MB = (1, 4, 16, 25, 64)
ROUNDS = 7


def _ways(x: torch.Tensor, out: torch.Tensor, rank: int) -> dict[str, Callable[[], None]]:
    from phalanx.parallel.collectives import start_reduce_scatter, wait_reduce_scatter

    n, world = out.numel(), dist.get_world_size()

    def all_reduce_copy() -> None:
        wait_reduce_scatter(start_reduce_scatter(out, x, None), None)

    def gloo_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(out, x)

    def exchange() -> None:
        peer = 1 - rank
        splits = [0, 0]
        splits[peer] = n
        dist.all_to_all_single(out, x[peer * n : (peer + 1) * n], splits, splits)
        out.add_(x[rank * n : (rank + 1) * n])

    ways = {"all_reduce+copy": all_reduce_copy, "gloo_reduce_scatter": gloo_reduce_scatter}
    return ways | ({"exchange": exchange} if world == 2 else {})


def _same_bits(n: int, rank: int, world: int) -> dict[str, dict[str, bool]]:
    """Each way's sums against gloo's reduce-scatter's, on every rank, per dtype."""
    same: dict[str, dict[str, bool]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
        gloos = torch.empty(n // world, dtype=dtype)
        dist.reduce_scatter_tensor(gloos, x.clone())
        ours = torch.empty_like(gloos)
        for name in _ways(x, ours, rank):
            if name == "gloo_reduce_scatter":
                continue
            _ways(x.clone(), ours, rank)[name]()  # each on a fresh copy: all-reduce is in place
            agree = torch.tensor([int(torch.equal(ours, gloos))])
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)
            same.setdefault(name, {})[str(dtype).removeprefix("torch.")] = bool(agree.item())
    return same


def _bench(rank: int, world: int, port: int, results: dict[str, object]) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one thread per rank: the ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 4 // world * world
        x, out = torch.randn(n), torch.empty(n // world)
        ways = _ways(x, out, rank)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(ROUNDS):
            for name, way in ways.items():
                dist.barrier()
                start = time.perf_counter()
                way()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratios = {
            f"{k}_over_all_reduce": round(v / ms["all_reduce+copy"], 3)
            for k, v in ms.items()
            if k != "all_reduce+copy"
        }
        rows.append({"mb": mb, "ms": {k: round(v, 2) for k, v in ms.items()}, **ratios,
                     "same_bits_as_gloo": _same_bits(n, rank, world)})  # fmt: skip
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
                            "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                            "torch": torch.__version__},
               "worlds": dict(results)}  # fmt: skip
    out = ROOT / "docs" / "results" / "gloo_reduce_scatter.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    for world, rows in figures["worlds"].items():
        for row in rows:
            print(f"world {world} {row['mb']:3d} MB: {row['ms']}  "
                  f"same bits as gloo's: {row['same_bits_as_gloo']}")  # fmt: skip


if __name__ == "__main__":
    main()
