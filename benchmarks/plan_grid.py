"""The planner against measurement: does the chosen plan fit, train under a cap, and run
close to the fastest configuration that fits?

For each model (a GPT and two MLPs, world 2, AdamW, the Trainer):

1. the machine is probed once (phalanx.train.plan.probe_job, a world-2 job) and the
   model counted on the meta device;
2. every candidate configuration (the planner's space here: stages 0-3 in
   memory, stage 1 and stage 3 with disk offload, stage 3 at fractions 1/4 to 1,
   and for the GPT two micro-batches) trains uncapped, each in fresh processes,
   for `--steps` steps: its peak RSS per rank (the larger rank's) and its median
   step time (steps after the first; the slower rank's);
3. for each budget, from roomy to the smallest that fits (for the largest model
   8x below its whole training state), the planner chooses among the same
   candidates; its predicted peak is set against the chosen configuration's
   measured one, its measured step time against the fastest candidate whose
   measured peak fits, and the chosen configuration trains again with each rank
   in a memory cgroup capped at the budget (cgroup v1 or v2; needs root).

Last, the Trainer with zero_stage="auto" (no budget given: it reads the cgroup)
under a cap that kills stage 0 trains to the loss of the uncapped stage-0 run.
Results: docs/results/plan_grid.json, and the tables docs/planner.md quotes.

    sudo python benchmarks/plan_grid.py                   # ~20 minutes on 2 cores
    sudo python benchmarks/plan_grid.py --models mlp-t --trainer-model mlp-t --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_grid_models as gm
from offload_cgroup import _join, cgroup_peak, make_cgroup

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "results" / "plan_grid.json"
WORKER = Path(__file__).resolve().parent / "plan_grid_worker.py"


def run(config: dict[str, Any], cap_mb: float | None, args: argparse.Namespace) -> dict[str, Any]:
    """One training run of 2 ranks, each in a cgroup capped at `cap_mb` (None: no cap)."""
    import functools

    from phalanx.ground.ports import free_port

    port = free_port()
    scratch = tempfile.mkdtemp(prefix="phalanx-grid-", dir=args.scratch)
    procs, groups = [], []
    for rank in range(2):
        group = make_cgroup(
            f"phalanx-grid-r{rank}", None if cap_mb is None else int(cap_mb * 2**20)
        )
        groups.append(group)
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT / 'src'}:{WORKER.parent}",
        }
        command = [sys.executable, str(WORKER), json.dumps({**config, "scratch": scratch})]
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=functools.partial(_join, group),
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n(timed out)")
    ranks = []
    for p, out, group in zip(procs, outputs, groups):
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        ranks.append(
            {
                "exit": p.returncode,
                "killed_by_kernel": p.returncode in (-9, 137),
                "cgroup_peak_mb": cgroup_peak(group),
                "result": json.loads(line[7:]) if line else None,
                "tail": [] if line else out.splitlines()[-4:],
            }
        )
    return {"config": config, "cap_mb": cap_mb, "ranks": ranks, **summary(ranks)}


def summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Trained or not; the larger rank's peak RSS; the median step (slower rank's each)."""
    results = [r["result"] for r in ranks]
    if any(r is None for r in results):
        return {"trained": False, "killed": any(r["killed_by_kernel"] for r in ranks)}
    steps = [max(pair) for pair in zip(*(r["step_s"] for r in results))][1:]
    return {
        "trained": True,
        "killed": False,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "step_s": statistics.median(steps) if steps else float("nan"),
        "loss": results[0]["loss"],
        "plan": results[0].get("plan"),
    }


def probe_rates(scratch: str) -> Any:
    """The machine's rates, probed by a world-2 job as `phalanx plan` probes them."""
    from phalanx.cli.plan_cmd import probe

    return probe(2, scratch)


def grid_for(name: str, rates: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every candidate of one model trained uncapped, then each budget planned and capped."""
    from phalanx.train.plan import NothingFits, choose

    spec = gm.MODELS[name]
    count = gm.count(name)
    configs = gm.candidates(name)
    earlier = args.reused.get("models", {}).get(name, {})
    measured = {}
    for config in configs:
        key = gm.key(config)
        if earlier.get("measured", {}).get(key, {}).get("trained"):
            measured[key] = earlier["measured"][key]  # --reuse: runs do not depend on the plan
            continue
        print(f"[{name}] uncapped {key} ...", flush=True)
        measured[key] = run(gm.worker_config(name, config, args.steps), None, args)
    cells = []
    for budget_mb in gm.budgets(name, count, rates, configs, args.budgets_per_model):
        try:
            choice = choose(
                count, rates, 2, spec.global_batch, budget_mb * 2**20, "grid", configs=configs
            )
        except NothingFits as exc:
            cells.append({"budget_mb": budget_mb, "nothing_fits": str(exc)})
            continue
        chosen = gm.key(choice.chosen.config)
        same = [
            c["capped_run"]
            for c in earlier.get("cells", [])
            if c.get("chosen") == chosen and c.get("budget_mb") == budget_mb and "capped_run" in c
        ]
        print(f"[{name}] {budget_mb:.0f} MB: {chosen}, capped ...", flush=True)
        capped = (
            same[0]
            if same
            else run(gm.worker_config(name, choice.chosen.config, args.steps), budget_mb, args)
        )
        cells.append(gm.cell(budget_mb, choice, measured, capped))
    return {"count": gm.count_json(count), "measured": measured, "cells": cells}


def trainer_check(rates: Any, args: argparse.Namespace) -> dict[str, Any]:
    """zero_stage="auto" under a cap that kills stage 0, against stage 0 uncapped."""
    name = args.trainer_model
    cap = gm.killing_cap(name, gm.count(name), rates)
    base = gm.worker_config(name, None, args.steps)
    return {
        "model": name,
        "cap_mb": cap,
        "stage0_capped": run({**base, "stage": 0}, cap, args),
        "auto_capped": run({**base, "auto": True}, cap, args),
        "stage0_uncapped": run({**base, "stage": 0}, None, args),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(gm.GRID))
    parser.add_argument("--budgets-per-model", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trainer-model", default="mlp-m")
    parser.add_argument("--scratch", default="/tmp/phalanx-plan-grid")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--reuse", type=Path, default=None, help="an earlier report's runs")
    parser.add_argument(
        "--every-from", type=Path, default=None, help="only add every prediction to this report"
    )
    args = parser.parse_args(argv)
    if args.every_from is not None:
        earlier = json.loads(args.every_from.read_text())
        earlier["every_configuration"] = every_configuration(earlier)
        args.every_from.write_text(json.dumps(earlier, indent=1))
        print(json.dumps(earlier["every_configuration"]["summary"]), flush=True)
        return 0
    args.reused = json.loads(args.reuse.read_text()) if args.reuse else {}
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rates = probe_rates(args.scratch)
    report: dict[str, Any] = {"rates": rates.to_json(), "models": {}}
    for name in args.models.split(","):
        report["models"][name] = grid_for(name, rates, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    report["trainer_check"] = trainer_check(rates, args)
    report["wall_s"] = time.monotonic() - start
    report["every_configuration"] = every_configuration(report)
    args.out.write_text(json.dumps(report, indent=1))
    print(gm.tables(report), flush=True)
    print(json.dumps(report["every_configuration"]["summary"]), flush=True)
    return 0


def every_configuration(report: dict[str, Any]) -> dict[str, Any]:
    """Every configuration that trained uncapped, predicted (from the report's own rates)
    against measured: not only the chosen ones. A pure function of the report, so that
    `--every-from REPORT` recomputes it without training."""
    from phalanx.train.plan.predict import predict_memory
    from phalanx.train.plan.probe import Rates

    rates = Rates(**report["rates"])
    rows = []
    for name, entry in report["models"].items():
        count = gm.count(name)
        for config in gm.candidates(name):
            measured = entry["measured"].get(gm.key(config), {})
            if not measured.get("trained"):
                continue
            predicted = predict_memory(config, count, 2, rates).total / 2**20
            rows.append({"model": name, "config": gm.key(config), "predicted_peak_mb": predicted,
                         "measured_peak_mb": measured["peak_rss_mb"],
                         "error": predicted / measured["peak_rss_mb"] - 1})  # fmt: skip
    out = [r for r in rows if abs(r["error"]) > 0.10]
    outside = [f"{r['model']} {r['config']} {r['error']:+.1%}" for r in out]
    summary = {"configurations": len(rows), "within_10_percent": len(rows) - len(out),
               "outside": outside}  # fmt: skip
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    sys.exit(main())
