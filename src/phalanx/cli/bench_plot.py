"""`phalanx bench`'s PNG: where a step's time goes, one stacked bar per world size.

matplotlib comes with the `bench` extra (pip install 'phalanx[bench]'); without
it the report is complete except for the picture, and says so.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.cli.bench_report import PARTS, WorldResult

_COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "exposed": "#c44e52",
    "optimizer": "#8172b2",
    "other": "#b0b0b0",
}


def plot_breakdown(results: list[WorldResult], path: Path) -> str:
    """Write the PNG; returns what to tell the user (its path, or why there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is missing (pip install 'phalanx[bench]')"
    fig, ax = plt.subplots(figsize=(3.6 + 1.4 * len(results), 4.2))
    labels = [f"world {r.world_size}" for r in results]
    bottom = [0.0] * len(results)
    for part in PARTS:
        heights = [r.parts_ms[part] for r in results]
        name = "exposed comm" if part == "exposed" else part
        ax.bar(labels, heights, bottom=bottom, color=_COLORS[part], label=name, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, r in enumerate(results):
        eff = f"\n{r.efficiency:.0%} eff." if r.efficiency is not None else ""
        hidden = f"\nhidden {r.hidden_ms:.1f} ms" if r.world_size > 1 else ""
        ax.annotate(
            f"{r.step_ms:.1f} ms{eff}{hidden}", (x, bottom[x]), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(0, max(bottom) * 1.35)  # the bars are the steps: their parts add up
    ax.set_title("phalanx bench: step time by world size", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
