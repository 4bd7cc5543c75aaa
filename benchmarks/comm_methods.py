"""Train with each way of communicating, side by side, and see what each buys and costs.

Two gloo ranks train six copies of each task's model (comm_tasks.py) for the
same samples, in the same order:

- `fp32`:      phalanx DDP, the default reducer: the exact all-reduce of every gradient;
- `bf16`:      phalanx DDP + `bf16_compress_hook`: half the bytes;
- `powersgd1`, `powersgd4`: phalanx DDP + PowerSGD of rank 1 / 4 (plain all-reduce for the
               first 10% of the steps, torch's advice for `start_powerSGD_iter`);
- `local8`:    `LocalSGD`, parameters averaged every 8 steps;
- `diloco8`:   `DiLoCo`, an outer Nesterov step (lr 0.7, momentum 0.9) every 8 steps.

A method that sends less may need more samples to reach the exact run's loss
yet still get there sooner. `--longer local8=1.5` adds a copy `local8@1.5x`
trained on 1.5 times the samples (its schedule stretched to match): its "wall
to fp32's final loss" is the time-to-target a longer budget buys. Its rounds
interleave with the others while they run, then continue alone.

All use AdamW with the same schedule. They run interleaved in rounds of 16
steps, in a balanced order (interleave.py), so machine noise hits all alike; a step's time is
the slower rank's. Reported per method: bytes sent per step (counted by the
method itself), step time ÷ fp32's (mean per round, median over rounds: a
round holds two local/DiLoCo syncs), the final validation loss, and the
training wall time until the validation loss first reached fp32's final one.
Validation runs every 16 steps, untimed, after syncs.

    python benchmarks/comm_methods.py                     # ~40 min on 2 shared cores
    python benchmarks/comm_methods.py --tiny --steps 32   # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import comm_tasks
import shaped_link
import torch
import torch.distributed as dist
from interleave import balanced_order
from spawn import run_ranks
from step_report import bootstrap_ci

import phalanx
from phalanx.ddp.comm_hooks import HookState, PowerSGDState, bf16_compress_hook, powersgd_hook
from phalanx.ddp.comm_stats import CommStats, tensor_bytes

METHODS = ("fp32", "bf16", "powersgd1", "powersgd4", "local8", "diloco8")
ROUND = 16  # steps per method per round; also the validation interval (a multiple of H=8)
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "comm_methods.json"
DEFAULT_PLOT = ROOT / "docs" / "img" / "comm_methods.png"


@dataclass(kw_only=True, frozen=True)
class Config:
    tasks: tuple[str, ...]
    steps: int
    """Optimizer steps per method (a multiple of 16); the sample budget is steps x batch x 2."""
    batch: int
    """Samples per rank per step."""
    seed: int
    tiny: bool
    longer: tuple[tuple[str, float], ...] = ()
    """(method, k): also train `method` on k times the samples, for time to target."""

    def variants(self) -> dict[str, tuple[str, int]]:
        """Each copy's name -> (its method, its steps)."""
        named = {m: (m, self.steps) for m in METHODS}
        for method, k in self.longer:
            named[f"{method}@{k:g}x"] = (method, math.ceil(self.steps * k / ROUND) * ROUND)
        return named


class Variant:
    """One method's copy of the model: how it steps, what it sent, how long steps took."""

    def __init__(self, method: str, steps: int, task: comm_tasks.Task, cfg: Config) -> None:
        torch.manual_seed(cfg.seed)
        self.module = task.build()
        self.task, self.method = task, method
        self.model: torch.nn.Module = self.module
        self.stats: CommStats | None = None
        opt_args: dict[str, Any] = {"lr": task.lr, "weight_decay": task.weight_decay}
        if method in ("local8", "diloco8"):
            self.optimizer = torch.optim.AdamW(self.module.parameters(), **opt_args)
            cls = phalanx.LocalSGD if method == "local8" else phalanx.DiLoCo
            self.sync = cls(self.module, self.optimizer, sync_every=8)
            self.stats = self.sync.stats
        else:
            self.model = phalanx.DistributedDataParallel(self.module)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **opt_args)
            self._register_hook(method, steps)
        self.total = steps
        self.steps_done = 0
        self.times: list[float] = []
        self.evals: list[tuple[int, float]] = [(0, validation_loss(self.module, task))]

    def _register_hook(self, method: str, steps: int) -> None:
        if method == "bf16":
            state = HookState()
            self.model.register_comm_hook(state, bf16_compress_hook)  # type: ignore[operator]
            self.stats = state.stats
        elif method.startswith("powersgd"):
            start = max(2, steps // 10)
            psgd = PowerSGDState(
                None, matrix_approximation_rank=int(method[-1]), start_powerSGD_iter=start
            )
            self.model.register_comm_hook(psgd, powersgd_hook)  # type: ignore[operator]
            self.stats = psgd.stats

    def step(self) -> None:
        x, y = self.task.batch(dist.get_rank(), self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = comm_tasks.char_gpt.lr_at(self.steps_done, self.total, self.task.lr)
        start = time.perf_counter()
        loss = self.task.loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()  # local8 / diloco8 synchronise in here every 8th step
        self.times.append(time.perf_counter() - start)
        self.steps_done += 1
        if self.steps_done % ROUND == 0:
            self.evals.append((self.steps_done, validation_loss(self.module, self.task)))

    def bytes_sent(self) -> dict[str, int]:
        if self.stats is not None:
            return self.stats.state_dict()
        # The default reducer all-reduces each bucket's whole flat buffer once per step.
        assert isinstance(self.model, phalanx.DistributedDataParallel)  # no hook, no stats
        per_step = sum(tensor_bytes(b.buffer) for b in self.model.reducer.buckets)
        grads = sum(tensor_bytes(p) for p in self.module.parameters())
        steps = self.steps_done
        return {"sent_bytes": per_step * steps, "gradient_bytes": grads * steps, "steps": steps}


@torch.no_grad()
def validation_loss(module: torch.nn.Module, task: comm_tasks.Task) -> float:
    """Mean loss over the validation set; each rank scores a share, the sums are all-reduced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, dtype=torch.float64)
    module.eval()
    for x, y in task.val[rank::world]:
        total += torch.tensor(
            [float(task.loss(module(x), y)) * len(y), len(y)], dtype=torch.float64
        )
    module.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def replica_spread(module: torch.nn.Module) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    gap = torch.tensor([float((flat - ref).abs().max())])
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


def run_task(name: str, cfg: Config, rank: int) -> dict[str, Any]:
    task = comm_tasks.TASKS[name](cfg.tiny, cfg.batch, cfg.seed)
    variants = {n: Variant(m, steps, task, cfg) for n, (m, steps) in cfg.variants().items()}
    names = list(variants)
    rounds = max(v.total for v in variants.values()) // ROUND
    for r in range(rounds):
        for n in balanced_order(r, names):
            if variants[n].steps_done == variants[n].total:
                continue
            dist.barrier()  # both ranks time the same steps
            for _ in range(ROUND):
                variants[n].step()
        if rank == 0 and r % 5 == 0:
            print(f"  {name}: round {r + 1}/{rounds}", flush=True)
    return {
        "params": sum(p.numel() for p in variants["fp32"].module.parameters()),
        "optimum": task.optimum,
        "methods": {
            m: {
                "times": v.times,
                "evals": v.evals,
                "bytes": v.bytes_sent(),
                "spread": replica_spread(v.module),
            }
            for m, v in variants.items()
        },
    }


def rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    return {name: run_task(name, cfg, rank) for name in cfg.tasks}


# ------------------------------------------------------------------ summary


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: bytes, paired step-time ratio, final loss, wall time to fp32's final loss."""
    methods = ranks[0]["methods"]
    walls = {
        m: [max(ts) for ts in zip(*(r["methods"][m]["times"] for r in ranks))] for m in methods
    }
    base = walls["fp32"]
    target = methods["fp32"]["evals"][-1][1]
    rows = {}
    for m, data in methods.items():
        cumulative = [0.0]
        for t in walls[m]:
            cumulative.append(cumulative[-1] + t)
        ratios = [  # over the rounds fp32 ran in
            statistics.fmean(walls[m][i : i + ROUND]) / statistics.fmean(base[i : i + ROUND])
            for i in range(0, min(len(base), len(walls[m])), ROUND)
        ]
        reached = next((step for step, loss in data["evals"] if loss <= target), None)
        sent = data["bytes"]
        rows[m] = {
            "bytes_per_step": sent["sent_bytes"] / max(1, sent["steps"]),
            "compression_ratio": sent["sent_bytes"] / max(1, sent["gradient_bytes"]),
            "step_time_vs_fp32": statistics.median(ratios),
            "step_time_vs_fp32_ci90": bootstrap_ci(ratios),
            "final_val_loss": data["evals"][-1][1],
            "wall_s": cumulative[-1],
            "wall_to_fp32_final_s": None if reached is None else cumulative[reached],
            "curve": [(cumulative[step], loss) for step, loss in data["evals"]],
            "replica_spread": max(r["methods"][m]["spread"] for r in ranks),
        }
    for row in rows.values():
        reach = row["wall_to_fp32_final_s"]
        row["wall_to_fp32_final_vs_fp32"] = (
            None if reach is None else reach / rows["fp32"]["wall_s"]
        )
    return {"params": ranks[0]["params"], "optimum": ranks[0]["optimum"], "methods": rows}


def markdown_table(name: str, summary: dict[str, Any]) -> str:
    rows = summary["methods"]
    lines = [
        f"**{name}** ({summary['params'] / 1e6:.2f}M parameters"
        + (
            f"; best possible validation loss {summary['optimum']:.4f}"
            if summary["optimum"]
            else ""
        )
        + ")",
        "",
        "| method | MB sent / step | sent ÷ gradients | step time ÷ fp32 | final val loss "
        "| vs fp32 | wall to fp32's final loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    fp32_loss = rows["fp32"]["final_val_loss"]
    for m, r in rows.items():
        reach = r["wall_to_fp32_final_vs_fp32"]
        reached = (
            "not reached" if reach is None else f"{r['wall_to_fp32_final_s']:.0f} s ({reach:.2f}x)"
        )
        lo, hi = r["step_time_vs_fp32_ci90"]
        lines.append(
            f"| {m} | {r['bytes_per_step'] / 1e6:.3f} | {r['compression_ratio']:.4f} "
            f"| {r['step_time_vs_fp32']:.2f} [{lo:.2f}, {hi:.2f}] | {r['final_val_loss']:.4f} "
            f"| {100 * (r['final_val_loss'] / fp32_loss - 1):+.1f}% | {reached} |"
        )
    return "\n".join(lines)


def plot(summaries: dict[str, dict[str, Any]], path: Path, link: str = "loopback") -> None:
    """Validation loss against training wall time, one panel per task (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return
    fig, axes = plt.subplots(1, len(summaries), figsize=(6 * len(summaries), 4.2), squeeze=False)
    for ax, (name, summary) in zip(axes[0], summaries.items()):
        for m, row in summary["methods"].items():
            xs, ys = zip(*row["curve"])
            ax.plot(xs, ys, label=m, linewidth=2 if m == "fp32" else 1.3)
        ax.axhline(summary["methods"]["fp32"]["final_val_loss"], color="grey", ls="--", lw=0.8)
        if summary["optimum"]:
            ax.axhline(summary["optimum"], color="black", ls=":", lw=0.8, label="optimum")
        ax.set_yscale("log")
        ax.set_title(f"{name}: validation loss (world 2, gloo, {link})")
        ax.set_xlabel("training wall time (s)")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def default_path(path: Path, link_gbit: float | None) -> Path:
    """`path`, or beside it `NAME_<rate>gbit.EXT` for a run behind a shaped link."""
    if link_gbit is None:
        return path
    return path.with_name(f"{path.stem}_{link_gbit:g}gbit{path.suffix}")


def parse_args(argv: list[str] | None) -> tuple[Config, Path, Path, float | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="mlp,gpt", help="comma-separated: mlp, gpt")
    p.add_argument("--steps", type=int, default=320, help="steps per method (multiple of 16)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny models: smoke-test the script")
    p.add_argument(
        "--longer",
        default="local8=1.1,local8=1.25",
        help="METHOD=K,...: also train METHOD on K times the samples (time to target); '' for none",
    )
    p.add_argument(
        "--link-gbit",
        type=float,
        default=None,
        help="run behind a loopback shaped to this many Gbit/s (a network namespace; root)",
    )
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    p.add_argument("--plot", type=Path, default=None, help=f"default {DEFAULT_PLOT}")
    a = p.parse_args(argv)
    tasks = tuple(t.strip() for t in a.tasks.split(",") if t.strip())
    if not tasks or set(tasks) - set(comm_tasks.TASKS):
        p.error(f"--tasks: choose from {sorted(comm_tasks.TASKS)}")
    if a.steps < ROUND or a.steps % ROUND:
        p.error(f"--steps must be a positive multiple of {ROUND}")
    longer = []
    for item in filter(None, (i.strip() for i in a.longer.split(","))):
        method, _, k = item.partition("=")
        try:
            factor = float(k)
        except ValueError:
            factor = 0.0
        if method not in METHODS or not 1.0 < factor <= 4.0:
            p.error(f"--longer {item!r}: want METHOD=K with METHOD in {METHODS} and 1 < K <= 4")
        longer.append((method, factor))
    return (
        Config(
            tasks=tasks,
            steps=a.steps,
            batch=a.batch,
            seed=a.seed,
            tiny=a.tiny,
            longer=tuple(longer),
        ),
        a.out or default_path(DEFAULT_OUT, a.link_gbit),
        a.plot or default_path(DEFAULT_PLOT, a.link_gbit),
        a.link_gbit,
    )


def main(argv: list[str] | None = None) -> int:
    cfg, out, plot_path, link_gbit = parse_args(argv)
    if link_gbit is not None and shaped_link.link_rate() is None:
        shaped_link.tbf_args(link_gbit)  # a bad rate fails here, before any namespace
        args = sys.argv[1:] if argv is None else argv
        return shaped_link.rerun_behind_link(link_gbit, __file__, args)
    link = f", behind a {link_gbit:g} Gbit/s shaped loopback" if link_gbit else ", over loopback"
    print(
        f"comm methods: 2 gloo ranks x 1 thread, {cfg.steps} steps x {cfg.batch} samples "
        f"per rank{link}"
    )
    started = time.monotonic()
    ranks = run_ranks(rank_main, 2, cfg)
    summaries = {name: summarise([r[name] for r in ranks]) for name in cfg.tasks}
    for name, summary in summaries.items():
        print(markdown_table(name, summary) + "\n")
    result = {
        "config": {
            **asdict(cfg),
            "link_gbit": link_gbit,
            "torch": torch.__version__,
            "wall_s": time.monotonic() - started,
        }
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "tasks": summaries}, indent=1) + "\n")
    print(f"wrote {out}")
    plot(summaries, plot_path, f"{link_gbit:g} Gbit/s link" if link_gbit else "loopback")
    apart = [
        (n, m) for n, s in summaries.items() for m, r in s["methods"].items() if r["replica_spread"]
    ]
    if apart:
        print(f"FAIL: replicas differ at the end for {apart}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
