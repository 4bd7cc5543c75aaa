"""What the reducer's Python costs per parameter: the hook path on the 261-tensor GPT model.

torch DDP does its per-parameter work in C++; ours runs a Python hook per parameter
per step, plus the bucket launches and the end-of-backward write-back. This measures
that whole cost, one process, a world of one (no wire time, no other rank's noise):

    overhead per parameter = (step with phalanx DDP - step of the plain module) / tensors

Both copies of the model see the same tiny batch (so compute is small and the
reducer's share large), interleaved in rounds, medians of CPU time per step. Run it
before and after a change of the hook path, and compare the two figures:

    python benchmarks/hook_path.py               # about a minute
    python benchmarks/hook_path.py --steps 4000  # tighter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import models
import torch
import torch.distributed as dist
from torch import nn

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "hook_path.json"


def tiny_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of 4 tokens: the smallest step, so the per-parameter work stands out."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, 5), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    inputs, targets = batch

    def step() -> None:
        models.token_loss(model(inputs), targets).backward()
        for p in model.parameters():
            p.grad = None

    return step


def measure(steps: int, rounds: int, warmup: int) -> dict[str, float]:
    from phalanx import DistributedDataParallel

    spec = models.gpt_spec(tiny=False)
    torch.manual_seed(0)
    plain = spec.build()
    torch.manual_seed(0)
    wrapped = DistributedDataParallel(spec.build())
    tensors = sum(1 for _ in plain.parameters())
    batch = tiny_batch(vocab=512)
    variants = {"plain": make_step(plain, batch), "phalanx": make_step(wrapped, batch)}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            fn = variants[name]
            for _ in range(per_round):
                start = time.process_time_ns()
                fn()
                cpu[name].append((time.process_time_ns() - start) / 1e3)
    plain_us = statistics.median(cpu["plain"])
    ddp_us = statistics.median(cpu["phalanx"])
    return {
        "tensors": tensors,
        "plain_step_us": plain_us,
        "phalanx_step_us": ddp_us,
        "overhead_per_param_us": (ddp_us - plain_us) / tensors,
        "steps_per_variant": len(cpu["plain"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = measure(args.steps, args.rounds, args.warmup)
    finally:
        dist.destroy_process_group()
    print(
        f"gpt ({result['tensors']} tensors, batch 1x4): plain {result['plain_step_us']:.0f} us, "
        f"phalanx DDP {result['phalanx_step_us']:.0f} us per step (CPU, median) -> "
        f"{result['overhead_per_param_us']:.2f} us per parameter"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
