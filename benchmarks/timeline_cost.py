"""What the timeline costs, and what it shows: the step of each model, with and without it.

Two gloo ranks train three copies of each model side by side, interleaved in
rounds as ddp_step.py does (A B C, B C A, ...):

- `compute`:  the plain module, forward/backward/optimizer timed into a timeline of its
              own (no communication): where a step's compute goes;
- `phalanx`:  phalanx DDP with the timeline off;
- `timeline`: phalanx DDP with the timeline on (forward, backward, every bucket's
              flight, the final wait, the optimizer step).

The cost is `timeline` ÷ `phalanx` (median step; and paired by round, which cancels
drifts in machine load). The breakdown is read from the two timelines the way
`phalanx bench` reads them, and the all-reduce of the very same buckets is then
timed alone (phalanx.ddp.allreduce_probe): together they say where the
time of a DDP step goes that compute alone does not spend.

    python benchmarks/timeline_cost.py                 # ~3 minutes on 2 cores
    python benchmarks/timeline_cost.py --models mlp --steps 400 --rounds 80
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import models
import spawn
import torch
import torch.distributed as dist
from interleave import balanced_order
from step_report import bootstrap_ci, round_ratios, round_sizes, slowest_rank_ms

from phalanx.cli.bench_report import analyze_trace
from phalanx.ddp.allreduce_probe import time_all_reduce
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.trace import merge

VARIANTS = ("compute", "phalanx", "timeline")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "timeline_cost.json"


class Copy:
    """One trained copy: model, optimizer, batches, its timeline (or None), step times."""

    def __init__(self, model: torch.nn.Module, spec: models.ModelSpec, batches: list[Any],
                 timeline: timelines.Timeline | None) -> None:  # fmt: skip
        self.model, self.spec, self.batches, self.timeline = model, spec, batches, timeline
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.done = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the whole process's CPU seconds, gloo's threads too
        self.plain = not hasattr(model, "reducer")  # compute alone: we record its spans

    def step(self) -> None:
        inputs, targets = self.batches[self.done % len(self.batches)]
        tl, plain = self.timeline, self.plain
        with timelines.forward_of(tl if plain else None, len(inputs)):
            loss = self.spec.loss(self.model(inputs), targets)
        with timelines.local_backward_of(tl if plain else None, True):
            loss.backward()
        with timelines.span_of(tl, "optimizer step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.done += 1

    def timed_step(self) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        self.step()
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - cpu)


def run_model(
    name: str, cfg: argparse.Namespace, rank: int, world: int, tmp: str
) -> dict[str, Any]:
    from phalanx import DistributedDataParallel

    spec = models.SPECS[name](False)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [spec.make_batch(g) for _ in range(8)]
    copies: dict[str, Copy] = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        module = spec.build()
        model = module if variant == "compute" else DistributedDataParallel(module)
        tl = None
        if variant != "phalanx":
            tl = timelines.Timeline(Path(tmp) / f"{name}-{variant}.json", rank, world)
            if variant == "timeline":
                assert isinstance(model, DistributedDataParallel)
                model.timeline = tl
        copies[variant] = Copy(model, spec, batches, tl)
    for variant in VARIANTS:
        for _ in range(cfg.warmup):
            copies[variant].step()
    for r, size in enumerate(round_sizes(cfg.steps, cfg.rounds)):
        for variant in balanced_order(r, VARIANTS):
            dist.barrier()
            for _ in range(size):
                copies[variant].timed_step()
    result: dict[str, Any] = {
        "times": {v: c.times for v, c in copies.items()},
        "cpu_times": {v: c.cpu_times for v, c in copies.items()},
    }
    for variant in ("compute", "timeline"):
        tl = copies[variant].timeline
        assert tl is not None
        tl.write()
        dist.barrier()
        if rank == 0:
            trace = merge(tl.path, world, wait_s=30)
            result[f"{variant}_breakdown"] = analyze_trace(trace, cfg.warmup).to_dict()
    sizes = sorted({int(b) for b in result.get("timeline_breakdown", {}).get("bucket_bytes", [])})
    sizes_obj = [sizes]
    dist.broadcast_object_list(sizes_obj, src=0)
    result["alone_ms"] = {n: time_all_reduce(n, torch.device("cpu")) for n in sizes_obj[0]}
    return result


def run_rank(rank: int, world: int, cfg: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        # Both ranks write into rank 0's directory name: one machine, one /tmp.
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        return {name: run_model(name, cfg, rank, world, box[0]) for name in cfg.models}


def recording_us_per_step(buckets: int, steps: int = 20_000) -> float:
    """The timeline's own work per step, timed directly: what the end-to-end ratio cannot
    resolve on a busy machine. One step: a forward span, backward start, `buckets` flights
    (each with a completion callback on an already completed future), the final wait and
    the optimizer span."""
    done: torch.futures.Future[None] = torch.futures.Future()
    done.set_result(None)
    with tempfile.TemporaryDirectory() as tmp:
        tl = timelines.Timeline(Path(tmp) / "t.json", 0, 1)
        start = time.process_time()  # CPU time: other jobs on the machine do not count
        for _ in range(steps):
            with tl.forward(32):
                pass
            tl.backward_started()
            for k in range(buckets):
                tl.bucket_launched(k, 1 << 20, done)
            now = time.perf_counter_ns()
            tl.backward_waited(now, now)
            with tl.span("optimizer step"):
                pass
            if len(tl.spans) > 100_000:  # stay under the span cap
                tl.spans.clear()
                tl.steps.clear()
        return (time.process_time() - start) / steps * 1e6


def summarise(name: str, ranks: list[dict[str, Any]], cfg: argparse.Namespace) -> dict[str, Any]:
    per = [r[name] for r in ranks]
    walls = {v: slowest_rank_ms(per, "times", v) for v in VARIANTS}
    paired = round_ratios(walls["timeline"], walls["phalanx"], round_sizes(cfg.steps, cfg.rounds))
    med = {v: statistics.median(ms) for v, ms in walls.items()}
    cpu = {v: statistics.median(slowest_rank_ms(per, "cpu_times", v)) for v in VARIANTS}
    return {
        "step_ms": med,
        "cpu_ms": cpu,
        "timeline_over_phalanx_cpu": cpu["timeline"] / cpu["phalanx"],
        "timeline_over_phalanx": med["timeline"] / med["phalanx"],
        "timeline_over_phalanx_paired": statistics.median(paired),
        "timeline_over_phalanx_paired_ci90": bootstrap_ci(paired),
        "compute": per[0]["compute_breakdown"],
        "ddp": per[0]["timeline_breakdown"],
        "buckets_alone_ms": per[0]["alone_ms"],
        "recording_us_per_step": recording_us_per_step(
            per[0]["timeline_breakdown"]["buckets_per_step"]
        ),
    }


def format_report(out: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, s in out.items():
        lo, hi = s["timeline_over_phalanx_paired_ci90"]
        med = s["step_ms"]
        lines.append(
            f"{name}: step ms compute {med['compute']:.2f}  phalanx {med['phalanx']:.2f}  "
            f"phalanx+timeline {med['timeline']:.2f}  cost x{s['timeline_over_phalanx']:.3f} "
            f"(paired {s['timeline_over_phalanx_paired']:.3f} [{lo:.3f}, {hi:.3f}])"
        )
        rec, cpu = s["recording_us_per_step"], s["cpu_ms"]
        lines.append(
            f"  CPU ms per step: phalanx {cpu['phalanx']:.2f}, +timeline {cpu['timeline']:.2f} "
            f"(x{s['timeline_over_phalanx_cpu']:.3f}); recording itself {rec:.1f} CPU us per "
            f"step = {rec / 10 / cpu['phalanx']:.3f}% of phalanx's CPU per step"
        )
        for label, b in (("compute alone", s["compute"]), ("phalanx DDP", s["ddp"])):
            parts = "  ".join(f"{k} {v:.2f}" for k, v in b["parts_ms"].items())
            lines.append(f"  {label:<14} step {b['step_ms']:.2f}: {parts}")
        d = s["ddp"]
        alone = sum(s["buckets_alone_ms"].get(str(n), s["buckets_alone_ms"].get(n, 0.0))
                    for n in d["bucket_bytes"])  # fmt: skip
        lines.append(
            f"  buckets {[round(b / 2**20, 2) for b in d['bucket_bytes']]} MB: in flight "
            f"{d['comm_busy_ms']:.2f} ms during training, {alone:.2f} ms alone; hidden "
            f"{d['hidden_ms']:.2f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,gpt,cnn")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    cfg = parser.parse_args(argv)
    cfg.models = [m for m in cfg.models.split(",") if m]
    ranks = spawn.run_ranks(run_rank, 2, cfg, threads=1, timeout=3600)
    out = {name: summarise(name, ranks, cfg) for name in cfg.models}
    print(format_report(out))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": {k: v for k, v in vars(cfg).items() if k != "out"}, "models": out}
    cfg.out.write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
