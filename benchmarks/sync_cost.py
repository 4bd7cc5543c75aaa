"""What one local SGD / DiLoCo average costs, with its flat buffer reused or made afresh.

Two gloo ranks average the 8.4M-parameter MLP's parameters (33.6 MB) with
`average_coalesced`, alternately through a flat buffer kept between calls (as
`LocalSGD` does) and through one allocated for the call, in rotating order;
medians of the per-call wall time on rank 0 and rank 1.

    python benchmarks/sync_cost.py --calls 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import models
import torch.distributed as dist
from spawn import run_ranks


def rank_main(rank: int, world: int, calls: int) -> dict[str, float]:
    from phalanx.ddp.comm_stats import CommStats
    from phalanx.optim.local_sgd import FlatBuffers, average_coalesced

    params = list(models.MLP([1024, 2048, 2048, 1024, 10]).parameters())
    stats, kept = CommStats(), FlatBuffers()
    times: dict[str, list[float]] = {"reused": [], "fresh": []}
    for i in range(calls):
        for name in ("reused", "fresh") if i % 2 else ("fresh", "reused"):
            dist.barrier()
            start = time.perf_counter()
            assert dist.group.WORLD is not None
            average_coalesced(params, dist.group.WORLD, stats, kept if name == "reused" else {})
            times[name].append(time.perf_counter() - start)
    warm = max(1, calls // 10)  # the first reused call makes the buffer
    return {name: 1000 * statistics.median(ts[warm:]) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    ranks: list[dict[str, Any]] = run_ranks(rank_main, 2, args.calls)
    for rank, ms in enumerate(ranks):
        print(
            f"rank {rank}: reused {ms['reused']:.1f} ms, fresh {ms['fresh']:.1f} ms per average "
            f"(ratio {ms['reused'] / ms['fresh']:.2f})"
        )


if __name__ == "__main__":
    main()
