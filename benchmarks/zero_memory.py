"""ZeRO memory per rank, counted from the tensors, and its step time next to plain DDP.

A ~50M-parameter GPT-style model (benchmarks/models.py's GPT: 13 blocks of width 512,
vocabulary 8192) trains with Adam under each stage at worlds 1, 2 and 4. Each
(world, stage) runs in fresh processes and reports, per rank:

- parameters, gradients and optimizer state in MB, counted from the tensors
  (unique storages: a view and its base count once). Gradients are every
  gradient buffer alive after backward: `.grad`s, DDP's bucket buffers, and
  ZeRO's shard gradients. "peak grad" is the most `.grad` memory alive at any
  point of backward (ZeRO-2 frees each bucket's `.grad`s as it launches it);
- peak RSS (whole process: the torch libraries too, about 0.3 GB of it).

Then, at world 2, the stages run side by side in one pair of processes,
interleaved round by round, for the step time ratios to DDP.

    python benchmarks/zero_memory.py                 # ~10 minutes on 2 cores
    python benchmarks/zero_memory.py --tiny          # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import models
import spawn
import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero_memory.json"
MB = 1024 * 1024
STAGES = (0, 1, 2, 3)


def build_model(tiny: bool) -> torch.nn.Module:
    if tiny:
        return models.GPT(vocab=64, seq_len=16, d_model=32, n_head=2, n_layer=2)
    return models.GPT(vocab=8192, seq_len=64, d_model=512, n_head=8, n_layer=13)


def batch(rank: int, step: int, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, seq = (64, 16) if tiny else (8192, 64)
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def wrap(stage: int, tiny: bool) -> tuple[Any, torch.optim.Optimizer]:
    """Stage 0: DDP + Adam; 1 and 2: DDP + ZeRO's Adam; 3: fully_shard each block, then
    the root, and a plain Adam over the pieces."""
    import phalanx

    torch.manual_seed(0)
    if stage == 3:
        net = build_model(tiny)
        for block in net.blocks:
            phalanx.fully_shard(block)
        phalanx.fully_shard(net)
        return net, torch.optim.Adam(net.parameters(), lr=1e-4)
    model = phalanx.DistributedDataParallel(build_model(tiny))
    if stage == 0:
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    zero = phalanx.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, shard_gradients=stage == 2, lr=1e-4
    )
    return model, zero


def storage_mb(tensors: Iterable[torch.Tensor | None]) -> float:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / MB


def gradient_tensors(model: Any, opt: Any) -> list[torch.Tensor | None]:
    grads = [p.grad for p in model.parameters()]
    if hasattr(model, "reducer"):
        grads += [b.buffer for b in model.reducer.buckets]
    if hasattr(opt, "optim"):
        grads += [s.grad for g in opt.optim.param_groups for s in g["params"]]
    return grads


def state_tensors(opt: Any) -> list[torch.Tensor]:
    inner = opt.optim if hasattr(opt, "optim") else opt
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def watch_peak_transient(model: Any) -> Callable[[], float]:
    """The most full-size memory alive at once beyond what the table counts at rest.

    Stages 0-2: `.grad`s during backward (after the reducer's hook, which frees them in
    stage 2). Stage 3: gathered whole parameters and their `.grad`s, sampled at every
    unit's forward and at every gradient.
    """
    from phalanx import zero3

    units = [u for m in model.modules() if (u := zero3.unit_of(m)) is not None]
    params = list(model.parameters())
    fulls = [s.full for u in units for s in u.slots()]
    peak = [0.0]

    def sample(*_: Any) -> None:
        live = sum(g._storage.nbytes() for u in units for g in u.groups) / MB
        live += storage_mb([p.grad for p in fulls] if units else [p.grad for p in params])
        peak[0] = max(peak[0], live)

    for p in fulls or params:
        p.register_post_accumulate_grad_hook(sample)
    for u in units:
        u.module.register_forward_hook(sample)
    return lambda: peak[0]


def measure_rank(rank: int, world: int, stage: int, tiny: bool) -> dict[str, float]:
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, opt = wrap(stage, tiny)
    peak_grad = watch_peak_transient(model)
    loss_fn = models.token_loss
    grads_mb = 0.0
    for step in range(3):
        x, y = batch(rank, step, tiny)
        loss_fn(model(x), y).backward()
        grads_mb = storage_mb(gradient_tensors(model, opt))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "params_mb": storage_mb(model.parameters()),
        "grads_mb": grads_mb,
        "peak_grad_mb": peak_grad(),
        "state_mb": storage_mb(state_tensors(opt)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_model_mb": base_rss,
    }


def time_rank(rank: int, world: int, rounds: int, per_round: int, tiny: bool) -> dict[str, Any]:
    """All stages in this process, interleaved; per variant, each step's seconds."""
    import torch.distributed as dist

    from phalanx import zero3

    variants = {stage: wrap(stage, tiny) for stage in STAGES}
    start_stats: dict[str, float] = {}
    times: dict[int, list[float]] = {stage: [] for stage in STAGES}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up (allocator, DDP's bucket rebuild)
        order = STAGES[r % len(STAGES) :] + STAGES[: r % len(STAGES)]
        for stage in order:
            model, opt = variants[stage]
            for _ in range(per_round):
                dist.barrier()
                start = time.perf_counter()
                x, y = batch(rank, step, tiny)
                models.token_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
                if r:
                    times[stage].append(float(elapsed))
                step += 1
        if r == 0:
            start_stats = zero3.communication_stats(variants[3][0])
    end_stats = zero3.communication_stats(variants[3][0])
    steps = len(times[3])
    stage3 = {k: (end_stats[k] - start_stats[k]) / steps for k in end_stats}
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(variants[0][0].parameters(), variants[2][0].parameters())
    )  # stage 3's parameters are pieces: its parity is tests/distributed/test_zero3.py's
    return {"times": times, "stage2_vs_stage0_max_param_diff": diff, "stage3_comm": stage3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    memory: dict[str, Any] = {}
    for world in worlds:
        for stage in STAGES:
            ranks = spawn.run_ranks(
                measure_rank, world, stage, args.tiny, threads=max(1, 2 // world)
            )
            memory[f"world{world}-stage{stage}"] = ranks
            r0 = ranks[0]
            print(
                f"world {world} stage {stage}: params {r0['params_mb']:.0f} MB, grads "
                f"{r0['grads_mb']:.0f} MB (peak .grad {r0['peak_grad_mb']:.0f}), state "
                f"{r0['state_mb']:.0f} MB, peak RSS {max(r['peak_rss_mb'] for r in ranks):.0f} MB",
                flush=True,
            )
    timing = spawn.run_ranks(time_rank, 2, args.rounds, args.per_round, args.tiny)[0]
    medians = {s: statistics.median(timing["times"][s]) for s in STAGES}
    speed = {f"stage{s}_over_ddp": medians[s] / medians[0] for s in STAGES if s}
    comm = timing["stage3_comm"]
    print(f"world 2 step medians (s): {medians}; ratios to DDP: {speed}", flush=True)
    print(
        f"stage 3 per step: {comm['gathers']:.0f} all-gathers, {comm['gather_wait_s']:.3f} s "
        f"waiting for them (the rest overlapped compute), {comm['reduce_wait_s']:.3f} s waiting "
        "for reduce-scatters at the end of backward",
        flush=True,
    )
    result = {
        "model_params": sum(p.numel() for p in build_model(args.tiny).parameters()),
        "memory": memory,
        "step_s_median": medians,
        "speed": speed,
        "param_diff_stage2_vs_ddp": timing["stage2_vs_stage0_max_param_diff"],
        "stage3_comm_per_step": comm,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown_table(result))
    return 0


def markdown_table(result: dict[str, Any]) -> str:
    lines = [
        "| world | stage | params MB | grads MB | peak transient MB | optimizer state MB | "
        "state ÷ stage 0 | all ÷ stage 0 | peak RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory = result["memory"]
    for key, ranks in memory.items():
        world, stage = (
            int(part.removeprefix("world").removeprefix("stage")) for part in key.split("-")
        )
        r0 = ranks[0]
        base = memory[f"world{world}-stage0"][0]
        total = r0["params_mb"] + r0["grads_mb"] + r0["state_mb"]
        base_total = base["params_mb"] + base["grads_mb"] + base["state_mb"]
        lines.append(
            f"| {world} | {stage} | {r0['params_mb']:.0f} | {r0['grads_mb']:.0f} | "
            f"{r0['peak_grad_mb']:.0f} | {r0['state_mb']:.0f} | "
            f"{r0['state_mb'] / base['state_mb']:.3f} | {total / base_total:.3f} | "
            f"{max(r['peak_rss_mb'] for r in ranks):.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
