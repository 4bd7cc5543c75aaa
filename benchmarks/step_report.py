"""Summaries of ddp_step.py's raw step times: medians, ratios, their noise, and a table.

Kept apart from the rank side so the suite (suite.py) and the single run share it.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

BASE_VARIANTS = ("compute", "torch_ddp", "phalanx")


def round_sizes(steps: int, rounds: int) -> list[int]:
    """Split `steps` into `rounds` nearly equal rounds (the first ones take the remainder)."""
    base, extra = divmod(steps, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


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


def summarise(ranks: list[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """Per-variant medians of the per-step max over ranks, and the ratios the issue asks for."""
    stats: dict[str, dict[str, float]] = {}
    walls = {v: slowest_rank_ms(ranks, "times", v) for v in cfg.variants}
    sizes = round_sizes(cfg.steps, cfg.timed_rounds)
    for variant in cfg.variants:
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
        "bucket_sweep_ms": {
            v.removeprefix("phalanx@"): stats[v]["median_ms"]
            for v in cfg.variants
            if v.startswith("phalanx@")
        },
    }


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    header = (
        f"{'model':<6}{'params':>11}{'tensors':>9}{'compute ms':>12}{'torch DDP ms':>14}"
        f"{'phalanx ms':>12}{'ph÷torch':>10}{'ph÷comp':>9}{'torch÷comp':>12}  params match"
    )
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        med = {v: s["step_ms"][v]["median_ms"] for v in s["step_ms"]}
        check = "yes" if s["params_match"] else "NO"
        lines.append(
            f"{name:<6}{s['params']:>11,}{s['tensors']:>9}{med['compute']:>12.2f}"
            f"{med['torch_ddp']:>14.2f}{med['phalanx']:>12.2f}{s['phalanx_over_torch']:>10.3f}"
            f"{s['phalanx_over_compute']:>9.3f}{s['torch_over_compute']:>12.3f}"
            f"  {check} (max|Δ| {s['max_abs_param_diff']:.1e})"
        )
    sweeps = {n: s["bucket_sweep_ms"] for n, s in summaries.items() if s.get("bucket_sweep_ms")}
    for name, sweep in sweeps.items():
        default = summaries[name]["step_ms"]["phalanx"]["median_ms"]
        cells = "  ".join(f"{cap} MB {ms:.2f}" for cap, ms in sweep.items())
        lines.append(f"  {name} bucket sweep (ms): 25 MB {default:.2f}  {cells}")
    lines.append("ph÷torch paired by round: median [90% CI, this run]; CPU ms/step, all threads:")
    for name, s in summaries.items():
        lo, hi = s["phalanx_over_torch_paired_ci90"]
        cpu = " ".join(f"{v} {s['step_ms'][v]['cpu_median_ms']:.2f}" for v in BASE_VARIANTS)
        lines.append(
            f"  {name:<6}{s['phalanx_over_torch_paired']:.3f} [{lo:.3f}, {hi:.3f}]  "
            f"cpu: {cpu} (ph÷torch {s['phalanx_over_torch_cpu']:.3f})"
        )
    return "\n".join(lines)
