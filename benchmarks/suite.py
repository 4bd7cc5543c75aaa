"""`make bench`: the DDP benchmark suite, every model at worlds 2 and 4, and the launcher.

For each world size and model (benchmarks/models.py: mlp, gpt, cnn, mlp50):

1. phalanx vs torch DDP vs compute alone, interleaved (ddp_step.py);
2. phalanx's bucket sweep, 1, 5, 25, 100 MB and "auto", interleaved among
   themselves in a spawn of their own (half the memory of one spawn for all);
3. the launcher's own cost: command to first training step, `phalanx launch`
   against torchrun, interleaved (startup.py).

Writes benchmarks/results/suite.{json,md} and, with matplotlib (the `bench`
extra), bucket_sweep.png (step time against bucket size) and scaling.png
(step time ÷ compute alone against world size).

    python benchmarks/suite.py             # about 20 minutes on 2 cores
    python benchmarks/suite.py --quick     # a few minutes, fewer steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ddp_step
import startup
from step_report import summarise

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("mlp", "gpt", "cnn", "mlp50")
SWEEP = ("1", "5", "100", "auto")
# Timed steps per variant: fewer for the models whose step takes longer.
STEPS = {"mlp": 60, "gpt": 100, "cnn": 100, "mlp50": 24}


def run_one(
    model: str, world: int, sweep: tuple[str, ...], scale: float, tiny: bool = False
) -> dict[str, Any]:
    steps = max(4, int(STEPS[model] * scale))
    base = ddp_step.BenchConfig(
        models=(model,),
        steps=steps,
        warmup=3,
        rounds=max(2, steps // 4),
        threads=1,
        seed=0,
        tiny=tiny,
        phalanx_impl="phalanx",
        tolerance=1e-4,
        world_size=world,
    )
    _, ranks = ddp_step.launch(base, timeout=3600)
    result = summarise(ranks[model], base)
    if sweep:
        swept = ddp_step.BenchConfig(**{**vars_of(base), "bucket_sweep": sweep})
        _, sweep_ranks = ddp_step.launch(swept, timeout=3600)
        s = summarise(sweep_ranks[model], swept)
        result["bucket_sweep_ms"] = {"25": s["step_ms"]["phalanx"]["median_ms"]}
        result["bucket_sweep_ms"].update(s["bucket_sweep_ms"])
    return result


def vars_of(cfg: ddp_step.BenchConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| world | model | compute ms | torch DDP ms | phalanx ms | phalanx ÷ torch | "
        "paired by round | phalanx ÷ compute | 1 MB | 5 MB | 25 MB | 100 MB | auto | "
        "auto ÷ best fixed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in results["runs"].items():
        world, model = key.split("/")
        med = {v: r["step_ms"][v]["median_ms"] for v in ("compute", "torch_ddp", "phalanx")}
        sweep = r.get("bucket_sweep_ms", {})
        fixed = [sweep[c] for c in ("1", "5", "25", "100") if c in sweep]
        auto = sweep.get("auto")
        vs_best = f"{auto / min(fixed):.3f}" if auto and fixed else "—"
        cells = " | ".join(
            f"{sweep[c]:.1f}" if c in sweep else "—" for c in (*SWEEP[:2], "25", *SWEEP[2:])
        )
        lines.append(
            f"| {world} | {model} | {med['compute']:.1f} | {med['torch_ddp']:.1f} | "
            f"{med['phalanx']:.1f} | {r['phalanx_over_torch']:.3f} | "
            f"{r['phalanx_over_torch_paired']:.3f} | "
            f"{r['phalanx_over_compute']:.3f} | {cells} | {vs_best} |"
        )
    lines.append("")
    for key, what in (("phalanx_over_torch", "medians"), ("phalanx_over_torch_paired", "paired")):
        ratios = [r[key] for r in results["runs"].values()]
        lines.append(
            f"phalanx ÷ torch DDP ({what}): median {statistics.median(ratios):.3f} over models "
            f"and worlds, worst {max(ratios):.3f}."
        )
    if "startup" in results:
        s = results["startup"]
        lines.append(
            f"Command to first training step (2 ranks, median of {s['trials']}): phalanx launch "
            f"{s['median_s']['phalanx']:.2f} s, torchrun {s['median_s']['torchrun']:.2f} s: "
            f"ratio {s['ratio']:.2f}."
        )
    return "\n".join(lines)


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """bucket_sweep.png (each size's step ÷ the 25 MB step) and scaling.png (step ÷ compute)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plots", flush=True)
        return []
    runs = results["runs"]
    models = sorted({k.split("/")[1] for k in runs})
    worlds = sorted({int(k.split("/")[0]) for k in runs})
    colours = {w: f"C{i}" for i, w in enumerate(worlds)}
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for world in worlds:
            sweep = runs.get(f"{world}/{model}", {}).get("bucket_sweep_ms", {})
            fixed = sorted((float(c), ms) for c, ms in sweep.items() if c != "auto")
            if not fixed or "25" not in sweep:
                continue
            # Relative to the default size, so worlds of different step times share an axis.
            xs, ys = zip(*((mb, ms / sweep["25"]) for mb, ms in fixed))
            ax.plot(xs, ys, marker="o", color=colours[world], label=f"world {world}")
            if "auto" in sweep:
                ax.axhline(
                    sweep["auto"] / sweep["25"],
                    color=colours[world],
                    linestyle="--",
                    linewidth=1,
                    label=f"auto, world {world}",
                )
        ax.set_xscale("log")
        ax.set(title=model, xlabel="bucket_cap_mb", ylabel="step ÷ step at 25 MB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [out / "bucket_sweep.png"]
    fig.savefig(paths[0], dpi=110)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, model in enumerate(models):
        for key, style, who in (
            ("phalanx_over_compute", "-", "phalanx"),
            ("torch_over_compute", ":", "torch DDP"),
        ):
            pts = [(w, runs[f"{w}/{model}"][key]) for w in worlds if f"{w}/{model}" in runs]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{model}, {who}")
    ax.set(xlabel="world size", ylabel="step ÷ compute alone", xticks=worlds)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "scaling.png")
    fig.savefig(paths[1], dpi=110)
    return paths


def write(results: dict[str, Any], out: Path, started: float | None = None) -> str:
    """suite.json and suite.md as they stand; the markdown table."""
    if started is not None:
        results["wall_s"] = round(time.monotonic() - started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "suite.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the steps")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-startup", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny models: checks the script runs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    parser.add_argument(
        "--replot", action="store_true", help="redraw the table and plots from suite.json"
    )
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "suite.json").read_text())
        print(write(saved, args.out))
        for path in plots(saved, args.out):
            print(f"wrote {path}")
        return 0
    sweep = SWEEP
    scale = 0.25 if args.quick else 1.0
    started = time.monotonic()
    results: dict[str, Any] = {"runs": {}, "sweep": list(sweep)}
    for world in (int(w) for w in args.worlds.split(",")):
        for model in args.models.split(","):
            print(f"world {world}, {model}:", flush=True)
            results["runs"][f"{world}/{model}"] = run_one(model, world, sweep, scale, args.tiny)
            # After every run: a run cut short keeps what it measured.
            write(results, args.out, started)
    if not args.no_startup:
        results["startup"] = startup.measure(4 if args.quick else 8, "step", None)
    print(write(results, args.out, started))
    for path in plots(results, args.out):
        print(f"wrote {path}")
    bad = [k for k, r in results["runs"].items() if not r["params_match"]]
    if bad:
        print(f"FAIL: phalanx and torch DDP parameters differ on {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
