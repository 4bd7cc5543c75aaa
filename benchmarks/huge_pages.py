"""Transparent huge pages for the workers' malloc, off and on, interleaved in one run.

`phalanx launch` starts its workers with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`
(launch/workerenv.py): glibc's malloc then asks the kernel for huge pages
(madvise) for its large blocks, and a ZeRO-3 step, which makes its gathered
parameters, their gradients and its reduce-scatter inputs afresh for each use,
faults that memory in 2 MB at a time instead of 4 KB. This runs ds_offload.py's
phalanx variants (its MLP, world 2 on gloo, the Trainer at zero_stage=3; `-kept`:
zero3_reshard_after_forward=False) each way, a fresh pair of processes a run,
in a balanced order over `--rounds`: median step (the slower rank's), peak RSS.

    python benchmarks/huge_pages.py --batch 8          # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import ds_offload
import interleave

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "huge_pages.json"
TUNABLE = "glibc.malloc.hugetlb=1"


def _thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "none"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default="phalanx-cpu,phalanx-cpu-kept,phalanx-disk-kept")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="per run; the first is untimed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scratch", default="/tmp/phalanx-huge-pages")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    runs_of = [(name, huge) for name in names for huge in (False, True)]
    started = {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load": os.getloadavg()}
    runs: list[dict[str, Any]] = []
    for r in range(interleave.balanced_rounds(args.rounds, args.rounds, len(runs_of))):
        for name, huge in interleave.balanced_order(r, runs_of):
            args.huge_pages = huge
            run = ds_offload.launch(args, name, 29700 + len(runs))
            runs.append({**run, "huge_pages": huge})
            print(name, "huge pages" if huge else "4 KB pages", "done", flush=True)
    summary: dict[str, Any] = {}
    for name in names:
        row = {}
        for huge in (False, True):
            mine = [run for run in runs if run["variant"] == name and run["huge_pages"] == huge]
            steps = [t for run in mine for t in run["ranks"][0]["times"][1:]]
            row["huge" if huge else "small"] = {
                "median_step_s": statistics.median(steps),
                "peak_rss_mb_max": max(r["rss"] for run in mine for r in run["ranks"]),
                "losses_rank0": mine[0]["ranks"][0]["losses"],
            }
        row["huge_over_small_step"] = row["huge"]["median_step_s"] / row["small"]["median_step_s"]
        row["huge_over_small_rss"] = (
            row["huge"]["peak_rss_mb_max"] / row["small"]["peak_rss_mb_max"]
        )
        row["same_losses"] = row["huge"]["losses_rank0"] == row["small"]["losses_rank0"]
        summary[name] = row
    machine = {
        "cores": os.cpu_count(),
        "thp": _thp_mode(),
        "started": started,
        "load_at_end": os.getloadavg(),
    }
    config = {**vars(args), "out": str(args.out), "tunable": TUNABLE}
    config.pop("huge_pages", None)
    report = {"config": config, "machine": machine, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
