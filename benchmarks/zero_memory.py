"""ZeRO stages 0-3 against torch's own: memory per rank, and step time side by side.

Variants (world 2 by default; `--worlds` adds others for the memory table):

| variant       | what it is                                                             |
|---------------|------------------------------------------------------------------------|
| `ddp`         | phalanx.DistributedDataParallel + Adam (stage 0)                       |
| `torch_ddp`   | torch.nn.parallel.DistributedDataParallel + Adam                       |
| `zero1`       | phalanx DDP + phalanx.ZeroRedundancyOptimizer(Adam)                    |
| `torch_zero1` | torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(Adam)      |
| `zero2`       | phalanx DDP + ZeroRedundancyOptimizer(Adam, shard_gradients=True)      |
| `zero3`       | phalanx.fully_shard on each block, then the root; Adam                 |
| `torch_fsdp2` | torch.distributed.fsdp.fully_shard, the same units; Adam               |

Models: `gpt`, a 49M-parameter GPT (13 blocks of width 512, vocabulary 8192; what
stage 3 is for), and `mlp`, 8.4M parameters in 8 tensors (bandwidth-bound: where
ZeRO-1's parameter all-gather shows).

Memory: each variant in fresh processes, 3 steps; per rank, parameters,
gradients and optimizer state counted from the tensors (a DTensor by its local
shard; unique storages), and peak RSS (the whole process: about 0.3 GB of it is
torch itself). Time: every variant of a model lives in one pair of processes
and they take turns, round by round, in a balanced order (interleave.py); a
step is forward, backward, optimizer step, its time the slower rank's; medians
and ratios to torch's counterpart.

    python benchmarks/zero_memory.py                  # ~15 minutes on 2 cores
    python benchmarks/zero_memory.py --models mlp     # the ZeRO-1 comparison alone
    python benchmarks/zero_memory.py --tiny           # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import interleave
import load
import models
import spawn
import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero_memory.json"
MB = 1024 * 1024
VARIANTS = ("ddp", "torch_ddp", "zero1", "torch_zero1", "zero2", "zero3", "torch_fsdp2")
COUNTERPART = {"ddp": "torch_ddp", "zero1": "torch_zero1", "zero3": "torch_fsdp2", "zero2": "zero1"}
"""Each variant's ratio is to this one (zero2 against zero1: issue 42 asks stage 2 <= stage 1)."""


def spec(name: str, tiny: bool) -> models.ModelSpec:
    if name == "mlp":
        return models.mlp_spec(tiny)
    vocab, seq, d, heads, layers, batch = (
        (64, 16, 32, 2, 2, 2) if tiny else (8192, 64, 512, 8, 13, 2)
    )

    def make_batch(g: torch.Generator) -> models.Batch:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return models.ModelSpec(
        name="gpt",
        build=lambda: models.GPT(vocab, seq, d, heads, layers),
        make_batch=make_batch,
        loss=models.token_loss,
    )


def units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """What each fully_shard variant shards first: the blocks of a GPT, the Linears of an MLP."""
    blocks = getattr(net, "blocks", None)
    if blocks is not None:
        return list(blocks)
    return [m for m in net.modules() if isinstance(m, torch.nn.Linear)]


def build(variant: str, model: models.ModelSpec) -> tuple[Any, torch.optim.Optimizer]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import phalanx

    torch.manual_seed(0)
    net = model.build()
    if variant in ("zero3", "torch_fsdp2"):
        shard = phalanx.fully_shard if variant == "zero3" else torch_fsdp.fully_shard
        for unit in units(net):
            shard(unit)
        shard(net)
        return net, torch.optim.Adam(net.parameters(), lr=1e-4)
    wrapped: Any = (
        TorchDDP(net) if variant.startswith("torch") else phalanx.DistributedDataParallel(net)
    )
    if variant in ("ddp", "torch_ddp"):
        return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-4)
    if variant == "torch_zero1":
        return wrapped, TorchZero(wrapped.parameters(), torch.optim.Adam, lr=1e-4)
    zero = phalanx.ZeroRedundancyOptimizer(
        wrapped.parameters(), torch.optim.Adam, shard_gradients=variant == "zero2", lr=1e-4
    )
    return wrapped, zero


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_mb(tensors: Iterable[torch.Tensor | None]) -> float:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and local(t).numel():
            storage = local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / MB


def gradient_tensors(model: Any, opt: Any) -> list[torch.Tensor | None]:
    grads = [p.grad for p in model.parameters()]
    reducer = getattr(model, "reducer", None)
    if reducer is not None and hasattr(reducer, "buckets"):  # phalanx DDP's flat buckets
        grads += [b.buffer for b in reducer.buckets]
    if hasattr(opt, "optim"):
        grads += [s.grad for g in opt.optim.param_groups for s in g["params"]]
    return grads


def state_tensors(opt: Any) -> list[torch.Tensor]:
    inner = opt.optim if hasattr(opt, "optim") else opt
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def measure_rank(
    rank: int, world: int, variant: str, model_name: str, tiny: bool
) -> dict[str, float]:
    model_spec = spec(model_name, tiny)
    model, opt = build(variant, model_spec)
    g = torch.Generator().manual_seed(rank)
    grads_mb = 0.0
    for _ in range(3):
        x, y = model_spec.make_batch(g)
        model_spec.loss(model(x), y).backward()
        grads_mb = storage_mb(gradient_tensors(model, opt))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "params_mb": storage_mb(model.parameters()),
        "grads_mb": grads_mb,
        "state_mb": storage_mb(state_tensors(opt)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def time_rank(
    rank: int,
    world: int,
    model_name: str,
    rounds: int,
    per_round: int,
    tiny: bool,
    names: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Every variant in this process, in a balanced order; per variant, each step's seconds."""
    import torch.distributed as dist

    model_spec = spec(model_name, tiny)
    variants = {v: build(v, model_spec) for v in names}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[float]] = {v: [] for v in names}
    rounds = interleave.balanced_rounds(rounds, 1, len(names))
    for r in range(rounds + 1):  # round 0 warms up (allocator, the DDPs' bucket rebuild)
        for variant in interleave.balanced_order(r, names):
            model, opt = variants[variant]
            dist.barrier()
            for _ in range(per_round):
                start, cpu_start = time.perf_counter(), time.process_time()
                x, y = model_spec.make_batch(g)
                model_spec.loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                used = time.process_time() - cpu_start  # every thread of this process
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
                if r:
                    times[variant].append(float(elapsed))
                    cpu[variant].append(used)
    return {"times": times, "cpu": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--worlds", default="2", help="worlds for the memory table")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="a subset to time, e.g. zero1,zero2"
    )
    parser.add_argument("--no-memory", action="store_true", help="time only (no memory table)")
    parser.add_argument(
        "--load", type=int, default=0, help="busy background processes while it times (load.py)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = tuple(v for v in VARIANTS if v in args.variants.split(","))
    result: dict[str, Any] = {
        "settings": {**vars(args), "out": str(args.out), "load": load.describe(args.load)},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for model_name in args.models.split(","):
        entry: dict[str, Any] = {
            "params": sum(p.numel() for p in spec(model_name, args.tiny).build().parameters())
        }
        for world in (int(w) for w in args.worlds.split(",")) if not args.no_memory else ():
            for variant in names:
                ranks = spawn.run_ranks(
                    measure_rank, world, variant, model_name, args.tiny, threads=max(1, 2 // world)
                )
                entry.setdefault("memory", {})[f"world{world}-{variant}"] = ranks
        with load.busy(args.load):
            timing = spawn.run_ranks(
                time_rank, 2, model_name, args.rounds, args.per_round, args.tiny, names
            )[0]
        medians = {v: statistics.median(timing["times"][v]) for v in names}
        entry["step_s_median"] = medians
        cpu = {v: statistics.median(timing["cpu"][v]) for v in names}
        entry["cpu_s_median_rank0"] = cpu
        pairs = {v: t for v, t in COUNTERPART.items() if v in names and t in names}
        entry["cpu_ratios"] = {f"{v}_over_{t}": cpu[v] / cpu[t] for v, t in pairs.items()}
        entry["ratios"] = {f"{v}_over_{t}": medians[v] / medians[t] for v, t in pairs.items()}
        if "torch_ddp" in names:
            entry["ratios"].update(
                {f"{v}_over_torch_ddp": medians[v] / medians["torch_ddp"] for v in names}
            )
        result[model_name] = entry
        print(markdown_table(model_name, entry), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


def markdown_table(model_name: str, entry: dict[str, Any]) -> str:
    lines = [
        f"{model_name} ({entry['params'] / 1e6:.1f}M parameters), world 2:",
        "",
        "| variant | params MB | grads MB | optimizer state MB | peak RSS MB (max rank) | "
        "step ms (median) | ÷ torch DDP | ÷ counterpart |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    medians = entry["step_s_median"]
    for variant in medians:
        ranks = entry.get("memory", {}).get(f"world2-{variant}")
        r0 = ranks[0] if ranks else {}
        counterpart = COUNTERPART.get(variant)
        vs = f"{medians[variant] / medians[counterpart]:.3f}" if counterpart in medians else ""
        to_ddp = f"{medians[variant] / medians['torch_ddp']:.3f}" if "torch_ddp" in medians else ""
        rss = max(r["peak_rss_mb"] for r in ranks) if ranks else float("nan")
        lines.append(
            f"| {variant} | {r0.get('params_mb', 0):.0f} | {r0.get('grads_mb', 0):.0f} | "
            f"{r0.get('state_mb', 0):.0f} | {rss:.0f} | {medians[variant] * 1e3:.1f} | "
            f"{to_ddp} | {vs} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
