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
from pathlib import Path
from typing import Any

import ds_offload
import interleave
import load

from phalanx.launch.workerenv import HUGE_PAGES

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "huge_pages.json"


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
    ds_offload.run_arguments(parser, batch=8, scratch="/tmp/phalanx-huge-pages")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    runs_of = [(name, huge) for name in names for huge in (False, True)]
    started = load.moment()
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
            row["huge" if huge else "small"] = ds_offload.variant_summary(mine)
        row["huge_over_small_step"] = row["huge"]["median_step_s"] / row["small"]["median_step_s"]
        row["huge_over_small_rss"] = (
            row["huge"]["peak_rss_mb_max"] / row["small"]["peak_rss_mb_max"]
        )
        row["same_losses"] = row["huge"]["losses_rank0"] == row["small"]["losses_rank0"]
        summary[name] = row
    machine = load.machine(started, thp=_thp_mode())
    config = {**vars(args), "out": str(args.out), "tunable": HUGE_PAGES}
    config.pop("huge_pages", None)
    report = {"config": config, "machine": machine, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
