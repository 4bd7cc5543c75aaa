"""The all-reduce alone, for `phalanx bench`: how long each message size takes on this group.

    phalanx launch --nproc-per-node 2 -m phalanx.ddp.allreduce_probe \\
        --sizes 1048576,4194304 --out probe.json

Each size is timed with nothing else running (one float32 tensor, averaged as
DDP averages), after a warm-up, as the median of several rounds, every
round started together behind a barrier; the fastest round counts, as what
the collective can do when nothing disturbs it. Rank 0 writes the times, so
`phalanx bench` can set the bandwidth a training step achieved against the
bandwidth the collective has on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.ddp.comm_hooks import GradBucket, HookState, bf16_compress_hook

# Rounds per size: many for small messages (a scheduler hiccup dwarfs them), few for large
# ones (a 64 MB gloo all-reduce takes ~0.1 s on two CPU ranks). Fixed counts: every rank
# runs the same rounds, or the barriers would pair up wrongly.
_ROUNDS = 15
_LARGE_ROUNDS = 3
_LARGE = 16 << 20
_WARMUP = 5


def time_all_reduce(nbytes: int, device: torch.device) -> float:
    """The fastest ms of one all-reduce of `nbytes` (rounded to float32 elements)."""
    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return _fastest_ms(lambda: dist.all_reduce(tensor), nbytes, device)


def time_bf16_hook(nbytes: int, device: torch.device) -> float:
    """The fastest ms of `bf16_compress_hook` averaging `nbytes` of float32 gradients.

    The hook itself, on one bucket of that size: the conversion to bf16 and back
    is part of its cost, and on a CPU it can outweigh the bytes it saves.
    """
    buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    state = HookState()

    def average() -> None:
        bf16_compress_hook(state, GradBucket(0, buffer, [], [], True)).wait()

    return _fastest_ms(average, nbytes, device)


def _fastest_ms(run: Callable[[], object], nbytes: int, device: torch.device) -> float:
    for _ in range(_WARMUP):  # connections, buffers, the allocator
        run()
    times: list[float] = []
    for _ in range(_LARGE_ROUNDS if nbytes >= _LARGE else _ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    # The collective is as slow as its slowest rank: agree on that one's time.
    mine = torch.tensor([min(times)], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item()) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument(
        "--bf16-hook-bytes", type=int, default=0, help="also time the bf16 hook on this many bytes"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = phalanx.init()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s})
    results = [{"bytes": n, "ms": time_all_reduce(n, world.device)} for n in sizes]
    record: dict[str, object] = {
        "world_size": world.world_size,
        "backend": world.backend,
        "sizes": results,
    }
    if args.bf16_hook_bytes > 0:
        hook_ms = time_bf16_hook(args.bf16_hook_bytes, world.device)
        record["bf16_hook"] = {"bytes": args.bf16_hook_bytes, "ms": hook_ms}
    if world.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    phalanx.shutdown()


if __name__ == "__main__":
    main()
