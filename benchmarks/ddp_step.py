"""Time one training step of phalanx DDP against torch DDP and against compute alone.

Two gloo ranks on this machine train three copies of each model side by side:

- `compute`:   the plain module, no communication: the floor for any reducer;
- `torch_ddp`: `torch.nn.parallel.DistributedDataParallel`, the bar to meet;
- `phalanx`:   `phalanx.DistributedDataParallel`, our reducer.

The variants run interleaved in rounds (A B C, B C A, C A B, C B A, A C B, B A C: each
runs in every position and right after every other variant equally often, interleave.py)
so that machine noise (the other rank, other jobs, thermal state) hits all three alike,
and so does whatever one variant leaves behind for the next. Every round starts
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
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import models
import spawn
import torch
import torch.distributed as dist
from interleave import balanced_order, balanced_rounds
from load import busy
from step_report import BASE_VARIANTS, format_table, round_sizes, summarise
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

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
    world_size: int = 2
    """gloo ranks on this machine."""
    bucket_sweep: tuple[str, ...] = ()
    """Extra phalanx variants, one per bucket_cap_mb (a number of MiB, or "auto")."""
    load: int = 0
    """Busy background processes while the ranks run (load.py): 0 is a quiet run."""

    @property
    def variants(self) -> tuple[str, ...]:
        return BASE_VARIANTS + tuple(f"phalanx@{cap}" for cap in self.bucket_sweep)

    @property
    def timed_rounds(self) -> int:
        """`rounds` raised to whole balanced cycles of the variants (interleave.py)."""
        return balanced_rounds(self.rounds, self.steps, len(self.variants))


def round_order(round_index: int, variants: tuple[str, ...] = BASE_VARIANTS) -> list[str]:
    """Each round's order: over a cycle, every variant runs in every position and right
    after every other variant equally often (interleave.py says why a rotation is not enough)."""
    return balanced_order(round_index, variants)


# ---------------------------------------------------------------- rank side


# A wrapper takes the module, and its options as keywords (the bucket sweep passes bucket_cap_mb).
Wrapper = Callable[..., nn.Module]


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
    spec: models.ModelSpec, batches: list[Any], cfg: BenchConfig, phalanx: Wrapper
) -> dict[str, Variant]:
    wrappers: dict[str, Wrapper] = {
        "compute": no_communication,
        "torch_ddp": TorchDDP,
        "phalanx": phalanx,
    }
    for cap in cfg.bucket_sweep:
        size: float | str = cap if cap == "auto" else float(cap)
        wrappers[f"phalanx@{cap}"] = functools.partial(phalanx, bucket_cap_mb=size)
    variants = {}
    for name in cfg.variants:
        torch.manual_seed(cfg.seed)  # identical initial weights in every variant
        variants[name] = Variant(wrappers[name](spec.build()), spec, batches)
    return variants


def tuning(model: nn.Module) -> bool:
    """Whether `bucket_cap_mb="auto"` is still trying sizes (its steps are not the choice's)."""
    tuner = getattr(getattr(getattr(model, "reducer", None), "plan", None), "tuner", None)
    return tuner is not None and not tuner.done


def run_rounds(variants: dict[str, Variant], cfg: BenchConfig) -> None:
    """Warm up every variant (auto's until it has chosen: every rank decides at the same
    step), then run the timed rounds, recording each step's seconds."""
    for name in cfg.variants:
        dist.barrier()
        for _ in range(cfg.warmup):
            variants[name].step()
        while tuning(variants[name].model):
            variants[name].step()
    for r, size in enumerate(round_sizes(cfg.steps, cfg.timed_rounds)):
        for name in round_order(r, cfg.variants):
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
    variants = build_variants(spec, batches, cfg, phalanx)
    run_rounds(variants, cfg)
    plain = variants["compute"].model
    return {
        "params": sum(p.numel() for p in plain.parameters()),
        "tensors": sum(1 for _ in plain.parameters()),
        "buffers": sum(1 for _ in plain.buffers()),
        "times": {n: v.times for n, v in variants.items()},
        "cpu_times": {n: v.cpu_times for n, v in variants.items()},
        "max_abs_diff": max(
            max_param_diff(variants[name].model, variants["torch_ddp"].model)
            for name in cfg.variants
            if name.startswith("phalanx")
        ),
    }


def run_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    """One rank (in a group spawn.run_ranks made): every model, its raw times by variant."""
    phalanx, impl = phalanx_ddp_class(cfg.phalanx_impl)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "impl": impl}
    per_model = {}
    for name in cfg.models:
        per_model[name] = run_model(name, cfg, rank, phalanx)
        if rank == 0:
            print(f"  {name}: done", flush=True)
    return {"env": env, "models": per_model}


# ---------------------------------------------------------------- parent side


def launch(cfg: BenchConfig, timeout: float) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run every rank; the environment they saw, and per model each rank's results."""
    ranks = spawn.run_ranks(run_rank, cfg.world_size, cfg, threads=cfg.threads, timeout=timeout)
    per_model = {name: [r["models"][name] for r in ranks] for name in cfg.models}
    return ranks[0]["env"], per_model


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
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks on this machine")
    p.add_argument(
        "--bucket-sweep",
        default="",
        help='extra phalanx variants by bucket_cap_mb, e.g. "1,5,100,auto"',
    )
    p.add_argument("--load", type=int, default=0, help="busy background processes (load.py)")
    a = p.parse_args(argv)
    names = tuple(m.strip() for m in a.models.split(",") if m.strip())
    unknown = sorted(set(names) - set(models.SPECS))
    if unknown or not names:
        p.error(f"--models: unknown {unknown or 'empty list'} — choose from {list(models.SPECS)}")
    if a.steps < 1 or a.rounds < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--steps, --rounds and --threads must be >= 1 and --warmup >= 0")
    cfg = BenchConfig(
        models=names,
        steps=a.steps,
        warmup=a.warmup,
        rounds=min(a.rounds, a.steps),
        threads=a.threads,
        seed=a.seed,
        tiny=a.tiny,
        phalanx_impl=a.phalanx_impl,
        tolerance=a.tolerance,
        world_size=a.world_size,
        bucket_sweep=tuple(c.strip() for c in a.bucket_sweep.split(",") if c.strip()),
        load=a.load,
    )
    return cfg, a.out, a.timeout


def main(argv: list[str] | None = None) -> int:
    cfg, out, timeout = parse_args(argv)
    print(
        f"DDP step benchmark: {cfg.world_size} gloo ranks x {cfg.threads} thread(s), "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps per variant in {cfg.timed_rounds} rounds",
        flush=True,
    )
    started = time.monotonic()
    with busy(cfg.load):
        env, per_model = launch(cfg, timeout)
    summaries = {name: summarise(ranks, cfg) for name, ranks in per_model.items()}
    if env.get("impl") != "phalanx":
        print(f"NOTE: the 'phalanx' column is {env.get('impl')}, not phalanx", flush=True)
    print(format_table(summaries))
    config = {
        **asdict(cfg),
        "world_size": cfg.world_size,
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
