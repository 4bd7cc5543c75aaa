"""Time one training step of phalanx DDP against torch DDP and against compute alone.

Two gloo ranks on this machine train three copies of each model side by side:

- `compute`:   the plain module, no communication: the floor for any reducer;
- `torch_ddp`: `torch.nn.parallel.DistributedDataParallel`, the bar to meet;
- `phalanx`:   `phalanx.DistributedDataParallel`, our reducer.

The variants run interleaved in rounds (A B C, B C A, C A B, ...) so that machine noise
(the other rank, other jobs, thermal state) hits all three alike. Every round starts
with a barrier so both ranks time the same steps; a step is forward + backward +
`optimizer.step()` + `zero_grad()`, and a step's time is the slower rank's (in
synchronous training the slower rank sets the pace). We report medians, since a step
that hit a scheduler hiccup should not move the result.

At the end the phalanx and torch replicas, which saw the same data in the same order,
must have the same parameters; if they do not, the run exits non-zero, so a reducer
that skips work cannot post a fast time.

    python benchmarks/ddp_step.py                      # 2-4 minutes on 2 cores
    python benchmarks/ddp_step.py --models mlp --steps 800 --rounds 160
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import models
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from phalanx.ports import free_port

VARIANTS = ("compute", "torch_ddp", "phalanx")
WORLD_SIZE = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ddp_step.json"


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """Everything a rank needs to run its part; plain values so it pickles to spawn."""

    models: tuple[str, ...]
    """Which models from models.SPECS to run, in this order."""
    steps: int
    """Timed steps per variant per model, split evenly over the rounds."""
    warmup: int
    """Untimed steps per variant first: allocator warm-up, DDP's first-step bucket rebuild."""
    rounds: int
    """How many A B C rounds the timed steps are split into."""
    threads: int
    """Intra-op threads per rank; 2 ranks x 1 thread fills a 2-core machine exactly."""
    seed: int
    """Seeds model init (same for every variant) and the data (different per rank)."""
    tiny: bool
    """Use the tiny models: a smoke test of the benchmark itself, not a measurement."""
    phalanx_impl: str
    """'phalanx', or 'nocomm': a reducer that communicates nothing, so the final parameter
    check must fail (how the benchmark's own guard is tested)."""
    tolerance: float
    """Largest |phalanx - torch| parameter difference accepted at the end."""


def round_sizes(steps: int, rounds: int) -> list[int]:
    """Split `steps` into `rounds` nearly equal rounds (the first ones take the remainder)."""
    base, extra = divmod(steps, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def round_order(round_index: int) -> list[str]:
    """Rotate the start each round so no variant always runs right after the same one."""
    shift = round_index % len(VARIANTS)
    return list(VARIANTS[shift:] + VARIANTS[:shift])


# ---------------------------------------------------------------- rank side


Wrapper = Callable[[nn.Module], nn.Module]


def no_communication(module: nn.Module) -> nn.Module:
    """A 'reducer' that does nothing: `--phalanx-impl nocomm` checks that the check catches it."""
    return module


def phalanx_ddp_class(impl: str) -> tuple[Wrapper, str]:
    """The wrapper to time as 'phalanx', and what it really is (recorded in the JSON)."""
    if impl == "nocomm":
        return no_communication, "nocomm-standin"
    from phalanx import DistributedDataParallel

    return DistributedDataParallel, "phalanx"


class Variant:
    """One trained copy of the model: its wrapper, optimizer, data position and timings."""

    def __init__(self, model: nn.Module, spec: models.ModelSpec, batches: list[Any]) -> None:
        self.model, self.spec, self.batches = model, spec, batches
        # Plain SGD keeps the optimizer step cheap and deterministic; momentum would only
        # add an identical elementwise pass to all three variants.
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.steps_done = 0
        self.times: list[float] = []  # wall seconds per timed step
        # CPU seconds of the whole process (gloo's threads too) per timed step: unlike wall
        # time it ignores other jobs on the machine, and wall minus CPU is time spent waiting.
        self.cpu_times: list[float] = []

    def step(self) -> None:
        inputs, targets = self.batches[self.steps_done % len(self.batches)]
        self.spec.loss(self.model(inputs), targets).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

    def timed_step(self) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        self.step()
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - cpu_start)


def build_variants(
    spec: models.ModelSpec, batches: list[Any], seed: int, phalanx: Wrapper
) -> dict[str, Variant]:
    wrappers = {"compute": no_communication, "torch_ddp": TorchDDP, "phalanx": phalanx}
    variants = {}
    for name in VARIANTS:
        torch.manual_seed(seed)  # identical initial weights in every variant
        variants[name] = Variant(wrappers[name](spec.build()), spec, batches)
    return variants


def run_rounds(variants: dict[str, Variant], cfg: BenchConfig) -> None:
    """Warm up every variant, then run the timed rounds, recording each step's seconds."""
    for name in VARIANTS:
        dist.barrier()
        for _ in range(cfg.warmup):
            variants[name].step()
    for r, size in enumerate(round_sizes(cfg.steps, cfg.rounds)):
        for name in round_order(r):
            dist.barrier()  # both ranks start the round together
            for _ in range(size):
                variants[name].timed_step()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest |a - b| over all parameters, maximised over ranks (so replicas are checked too)."""
    with torch.no_grad():
        worst = max(float((pa - pb).abs().max()) for pa, pb in zip(a.parameters(), b.parameters()))
    result = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result.item())


def run_model(name: str, cfg: BenchConfig, rank: int, phalanx: Wrapper) -> dict[str, Any]:
    spec = models.SPECS[name](cfg.tiny)
    # A small pool of batches, drawn before timing: data generation is not what we measure.
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    batches = [spec.make_batch(g) for _ in range(8)]
    variants = build_variants(spec, batches, cfg.seed, phalanx)
    run_rounds(variants, cfg)
    plain = variants["compute"].model
    return {
        "params": sum(p.numel() for p in plain.parameters()),
        "tensors": sum(1 for _ in plain.parameters()),
        "buffers": sum(1 for _ in plain.buffers()),
        "times": {n: v.times for n, v in variants.items()},
        "cpu_times": {n: v.cpu_times for n, v in variants.items()},
        "max_abs_diff": max_param_diff(variants["phalanx"].model, variants["torch_ddp"].model),
    }


def worker(rank: int, port: int, cfg: BenchConfig, results: Any) -> None:
    """One rank: join the group, run every model, post each model's raw times to the parent."""
    try:
        torch.set_num_threads(cfg.threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=timedelta(seconds=120),
        )
        phalanx, impl = phalanx_ddp_class(cfg.phalanx_impl)
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "impl": impl}
        results.put(("env", rank, env))
        for name in cfg.models:
            results.put(("model", rank, (name, run_model(name, cfg, rank, phalanx))))
        dist.destroy_process_group()
        results.put(("done", rank, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    # Flush the queue's feeder thread, then skip interpreter teardown (gloo threads can
    # make it slow); without the join, os._exit can drop the last message.
    results.close()
    results.join_thread()
    os._exit(0)


# ---------------------------------------------------------------- parent side


def launch(cfg: BenchConfig, timeout: float) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Spawn both ranks, collect their messages, and kill them if the deadline passes."""
    # The ranks inherit this environment and import torch only after it is set.
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    os.environ["MKL_NUM_THREADS"] = str(cfg.threads)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, cfg, results)) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    try:
        return collect(results, procs, timeout, cfg)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def collect(
    results: Any, procs: list[Any], timeout: float, cfg: BenchConfig
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    env: dict[str, Any] = {}
    per_model: dict[str, list[Any]] = {name: [None] * WORLD_SIZE for name in cfg.models}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(done) < WORLD_SIZE:
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark ran past --timeout {timeout:.0f}s — a rank hung?")
        try:
            kind, rank, payload = results.get(timeout=1.0)
        except queue.Empty:
            if any(not p.is_alive() for p in procs):
                raise SystemExit("a rank died without reporting — see its output above") from None
            continue
        if kind == "error":
            raise SystemExit(f"rank {rank} failed:\n{payload}")
        if kind == "env":
            env = payload
        elif kind == "model":
            name, data = payload
            per_model[name][rank] = data
            if rank == 0:
                print(f"  {name}: done", flush=True)
        else:
            done.add(rank)
    return env, per_model


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def slowest_rank_ms(ranks: list[dict[str, Any]], key: str, variant: str) -> list[float]:
    """Per step, the larger of the ranks' values, in milliseconds."""
    return [1000.0 * max(ts) for ts in zip(*(r[key][variant] for r in ranks))]


def round_ratios(num: list[float], den: list[float], sizes: list[int]) -> list[float]:
    """Per round, (round median of `num`) / (round median of `den`).

    Two variants' steps in one round ran seconds apart, so slow drifts in machine load
    cancel in their ratio; on a busy machine the median of these is steadier than the
    ratio of the overall medians.
    """
    ratios, start = [], 0
    for size in sizes:
        end = start + size
        ratios.append(statistics.median(num[start:end]) / statistics.median(den[start:end]))
        start = end
    return ratios


def bootstrap_ci(values: list[float], level: float = 0.9, resamples: int = 1000) -> list[float]:
    """Percentile bootstrap interval of the median: how far another run could plausibly land."""
    rng = random.Random(0)  # a fixed seed: the same data always gives the same interval
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    tail = (1.0 - level) / 2
    return [percentile(medians, tail), percentile(medians, 1.0 - tail)]


def summarise(ranks: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Per-variant medians of the per-step max over ranks, and the ratios the issue asks for."""
    stats: dict[str, dict[str, float]] = {}
    walls = {v: slowest_rank_ms(ranks, "times", v) for v in VARIANTS}
    sizes = round_sizes(cfg.steps, cfg.rounds)
    for variant in VARIANTS:
        ms = walls[variant]
        stats[variant] = {
            "median_ms": statistics.median(ms),
            "p25_ms": percentile(ms, 0.25),
            "p75_ms": percentile(ms, 0.75),
            "cpu_median_ms": statistics.median(slowest_rank_ms(ranks, "cpu_times", variant)),
            "steps": len(ms),
        }
    med = {v: s["median_ms"] for v, s in stats.items()}
    paired = round_ratios(walls["phalanx"], walls["torch_ddp"], sizes)
    diff = ranks[0]["max_abs_diff"]
    return {
        "params": ranks[0]["params"],
        "tensors": ranks[0]["tensors"],
        "buffers": ranks[0]["buffers"],
        "step_ms": stats,
        "phalanx_over_torch": med["phalanx"] / med["torch_ddp"],
        "phalanx_over_compute": med["phalanx"] / med["compute"],
        "torch_over_compute": med["torch_ddp"] / med["compute"],
        "phalanx_over_torch_paired": statistics.median(paired),
        "phalanx_over_torch_paired_ci90": bootstrap_ci(paired),
        "phalanx_over_torch_cpu": stats["phalanx"]["cpu_median_ms"]
        / stats["torch_ddp"]["cpu_median_ms"],
        "max_abs_param_diff": diff,
        "params_match": diff <= cfg.tolerance,
    }


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'model':<6}{'params':>11}{'tensors':>9}{'compute ms':>12}{'torch DDP ms':>14}"
        f"{'phalanx ms':>12}{'ph÷torch':>10}{'ph÷comp':>9}{'torch÷comp':>12}  params match"
    )
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        med = {v: s["step_ms"][v]["median_ms"] for v in VARIANTS}
        check = "yes" if s["params_match"] else "NO"
        lines.append(
            f"{name:<6}{s['params']:>11,}{s['tensors']:>9}{med['compute']:>12.2f}"
            f"{med['torch_ddp']:>14.2f}{med['phalanx']:>12.2f}{s['phalanx_over_torch']:>10.3f}"
            f"{s['phalanx_over_compute']:>9.3f}{s['torch_over_compute']:>12.3f}"
            f"  {check} (max|Δ| {s['max_abs_param_diff']:.1e})"
        )
    lines.append("ph÷torch paired by round: median [90% CI, this run]; CPU ms/step, all threads:")
    for name, s in summaries.items():
        lo, hi = s["phalanx_over_torch_paired_ci90"]
        cpu = " ".join(f"{v} {s['step_ms'][v]['cpu_median_ms']:.2f}" for v in VARIANTS)
        lines.append(
            f"  {name:<6}{s['phalanx_over_torch_paired']:.3f} [{lo:.3f}, {hi:.3f}]  "
            f"cpu: {cpu} (ph÷torch {s['phalanx_over_torch_cpu']:.3f})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, Path, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,gpt,cnn", help="comma-separated: mlp, gpt, cnn")
    p.add_argument("--steps", type=int, default=400, help="timed steps per variant per model")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=80, help="rounds the timed steps are split into")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny models: smoke-test the benchmark")
    p.add_argument("--phalanx-impl", choices=("phalanx", "nocomm"), default="phalanx")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |phalanx - torch| param")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill the ranks after this")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON")
    a = p.parse_args(argv)
    models = tuple(m.strip() for m in a.models.split(",") if m.strip())
    unknown = sorted(set(models) - {"mlp", "gpt", "cnn"})
    if unknown or not models:
        p.error(f"--models: unknown {unknown or 'empty list'} — choose from mlp, gpt, cnn")
    if a.steps < 1 or a.rounds < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--steps, --rounds and --threads must be >= 1 and --warmup >= 0")
    cfg = BenchConfig(
        models=models,
        steps=a.steps,
        warmup=a.warmup,
        rounds=min(a.rounds, a.steps),
        threads=a.threads,
        seed=a.seed,
        tiny=a.tiny,
        phalanx_impl=a.phalanx_impl,
        tolerance=a.tolerance,
    )
    return cfg, a.out, a.timeout


def main(argv: list[str] | None = None) -> int:
    cfg, out, timeout = parse_args(argv)
    print(
        f"DDP step benchmark: {WORLD_SIZE} gloo ranks x {cfg.threads} thread(s), "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps per variant in {cfg.rounds} rounds",
        flush=True,
    )
    started = time.monotonic()
    env, per_model = launch(cfg, timeout)
    summaries = {name: summarise(ranks, cfg) for name, ranks in per_model.items()}
    if env.get("impl") != "phalanx":
        print(f"NOTE: the 'phalanx' column is {env.get('impl')}, not phalanx", flush=True)
    print(format_table(summaries))
    config = {
        **asdict(cfg),
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "phalanx_impl_used": env.get("impl"),
        "torch_version": env.get("torch"),
        "threads_seen_by_torch": env.get("threads"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "models": summaries}, indent=2) + "\n")
    print(f"wrote {out}")
    bad = [n for n, s in summaries.items() if not s["params_match"]]
    if bad:
        print(f"FAIL: phalanx and torch DDP parameters differ on {bad} — the reducer is wrong")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
