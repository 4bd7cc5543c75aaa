"""Goodput under failures: live recovery against a restart from the checkpoint, interleaved.

Three ranks train the Trainer script of the live-recovery tests
(tests/faults/scripts/live_trainer.py: a small model, a fixed pause per step
standing in for a real model's compute) for a fixed number of steps, saving every
`--save-every` steps. Four variants take turns, round by round, in a balanced
order (interleave.py):

- `none`: no failure, the wall time the others are measured against;
- `quiet-live`: no failure, under --live-recovery and fault_tolerance="live": what live
  recovery costs by itself (at zero_stage 1-2, its snapshots passed to the neighbour);
- `live`: `phalanx launch --live-recovery --max-restarts 3`, fault_tolerance="live";
- `restart`: `phalanx launch --max-restarts 3`, every rank restarted from the last
  checkpoint (the steps since it are trained again).

In both failing variants rank 1 of the world is SIGKILLed in its forward at the
same three steps. Reported: each run's wall time, the lost time (variant minus
`none`, medians), and live's lost time / restart's (the target: <= 0.1).

    python benchmarks/live_goodput.py                 # ~6 minutes on 2 cores
    python benchmarks/live_goodput.py --rounds 1 --steps 90 --kills 20,40,60   # ~1 minute
    python benchmarks/live_goodput.py --zero-stage 1 --width 512 --depth 4 \
        --out docs/results/live_goodput_zero1.json    # ZeRO-1: snapshots every 10 steps
    python benchmarks/live_goodput.py --zero-stage 3 --nproc 4 --shard-size 2 ...  # HSDP 2x2:
        # a lost shard from its replica, no snapshot while the mesh is whole
    python benchmarks/live_goodput.py --zero-stage 3 --offload disk ...  # snapshots in files
    python benchmarks/live_goodput.py --zero-stage 3 --redundancy 1,2 --no-failures ...
        # what live_redundancy k costs: quiet-live-k1 and quiet-live-k2 against none

`--baseline-tree DIR` adds `quiet-live-base` and `live-base`: those variants with DIR's
src/ and DIR's test script (an older checkout: before/after, interleaved in one run).

Each live run's ledger also gives the bytes of snapshots a member holds in memory
(its parity) and in files (its own snapshot), the largest over members and steps; and
rank 0's step times say where a live run's lost time went (`live_phases_s`, medians,
each step less its run's median step): the steps members were lost in (the cut work,
the detection, the recovery, the step again), the first steps with a replacement in
(the agreement, the re-deal, its first step), the four steps after each, the other
steps, every step's median and the time outside the steps (the last three against
`none`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import interleave
from bytecode import compile_tree

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT_STEPS = 10
"""The script's live_snapshot_steps (TrainingArguments' default)."""
SCRIPT = ROOT / "tests" / "faults" / "scripts" / "live_trainer.py"
PEAK_RSS_MB: dict[str, list[float]] = {}
"""The largest rank's peak resident set of each run, by variant (what snapshots cost)."""
HELD_BYTES: dict[str, list[dict[str, float]]] = {}
"""Per run, by variant: the most snapshot bytes any member held in memory and in files."""
PHASES: dict[str, list[dict[str, float]]] = {}
"""Per run, by variant: where its wall time went (`_phases`)."""
AFTER_JOIN_STEPS = 4


def run_once(
    variant: str,
    steps: int,
    kills: str,
    save_every: int,
    pause_s: float,
    extra: dict[str, str],
    nproc: int = 3,
    baseline: Path | None = None,
) -> float:
    """Wall seconds of one launch to its exit (it must succeed)."""
    work = Path(tempfile.mkdtemp(prefix=f"goodput-{variant}-"))
    ledger = work / "ledger"
    ledger.mkdir()
    env = {**os.environ, "LEDGER_DIR": str(ledger), "OMP_NUM_THREADS": "1",
           "PAUSE_S": str(pause_s), "SAVE_STEPS": str(save_every), **extra}  # fmt: skip
    flags = ["--nproc-per-node", str(nproc), "--max-restarts", "3"]
    name, script = variant, SCRIPT
    if variant.endswith("-base") and baseline is not None:
        variant, script = variant.removesuffix("-base"), baseline / SCRIPT.relative_to(ROOT)
        env["PYTHONPATH"] = str(baseline / "src")
    if variant.endswith("-warm"):  # the workers forked from a warm server (forkstart.py)
        variant = variant.removesuffix("-warm")
        flags += ["--start-method", "forkserver"]
    variant, _, k = variant.partition("-k")
    if k:
        env["LIVE_REDUNDANCY"] = k
    if variant in ("live", "quiet-live"):
        flags += ["--live-recovery", "--live-stall-timeout", "2"]
    else:
        env["FAULT_TOLERANCE"] = "restart"
    if variant in ("live", "restart"):
        env["KILL_STEPS"] = kills
    argv = [sys.executable, "-m", "phalanx", "launch", *flags, str(script), str(work / "out")]
    argv += [str(steps), "resume"]
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    HELD_BYTES.setdefault(name, []).append(_held(ledger))
    PHASES.setdefault(name, []).append(_phases(ledger, wall))
    shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")  # fmt: skip
    peaks = [float(mb) for mb in re.findall(r"peak_rss_mb=(\S+)", done.stdout + done.stderr)]
    PEAK_RSS_MB.setdefault(name, []).append(max(peaks, default=0.0))
    return wall


def _held(ledger: Path) -> dict[str, float]:
    """The most snapshot bytes a member held, in memory and in files, over the run; and
    what a snapshot costs the step after it (rank 0's steps after a snapshot step, median,
    less its other steps' median: a figure within one run, free of the machine's drift)."""
    entries = [json.loads(line) for f in ledger.glob("*.jsonl") for line in f.open()]
    for e in entries:  # an older tree's ledger (--baseline-tree) may hold copies in memory only
        e.setdefault("copy_bytes_in_memory", e["copy_bytes"])
    memory = max((e["copy_bytes_in_memory"] for e in entries), default=0)
    files = max((e["copy_bytes"] - e["copy_bytes_in_memory"] for e in entries), default=0)
    first = ledger / "r0.jsonl"
    times = {e["step"]: e["t"] for e in map(json.loads, first.open())} if first.exists() else {}
    gaps = {s: times[s] - times[s - 1] for s in times if s - 1 in times and s > 2}
    after = [g for s, g in gaps.items() if (s - 1) % SNAPSHOT_STEPS == 0]
    other = [g for s, g in gaps.items() if (s - 1) % SNAPSHOT_STEPS != 0]
    extra = statistics.median(after) - statistics.median(other) if after and other else 0.0
    return {"memory": memory, "files": files, "snapshot_s": extra}


def _phases(ledger: Path, wall_s: float) -> dict[str, float]:
    """Where a run's wall time went, from rank 0's step times (rank 0 is never the one
    killed), each step less the run's median step: the step a member was lost in, the
    first step after a replacement joined, the AFTER_JOIN_STEPS after that one, every
    other step; and the time outside the steps (the launch, setup, the end)."""
    entries = sorted((json.loads(line) for line in (ledger / "r0.jsonl").open()),
                     key=lambda e: e["step"])  # fmt: skip
    gaps = [(b["t"] - a["t"], a["world"], b["world"]) for a, b in itertools.pairwise(entries)]
    median = statistics.median(g for g, _, _ in gaps)
    span = entries[-1]["t"] - entries[0]["t"]
    phases = dict.fromkeys(("lost_step_s", "join_step_s", "after_join_s", "other_steps_s"), 0.0)
    phases |= {"median_step_s": median, "steps": len(gaps), "span_s": span}
    phases["outside_s"] = wall_s - span
    after = 0
    for gap, before, now in gaps:
        kind = "other_steps_s"
        if now < before:
            kind = "lost_step_s"
        elif now > before:
            kind, after = "join_step_s", AFTER_JOIN_STEPS
        elif after:
            kind, after = "after_join_s", after - 1
        phases[kind] += gap - median
    return phases


def _lost_by_phase(live: list[dict[str, float]], none: list[dict[str, float]]) -> dict[str, float]:
    """The medians of `live`'s phases; its median step (times its steps), its other steps
    and its time outside the steps set against the run without failures: the parts sum to
    the lost time, up to the noise between the medians."""

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    parts = {k: median(live, k) for k in ("lost_step_s", "join_step_s", "after_join_s")}
    parts["other_steps_s"] = median(live, "other_steps_s") - median(none, "other_steps_s")
    parts["outside_s"] = median(live, "outside_s") - median(none, "outside_s")
    slower = median(live, "median_step_s") - median(none, "median_step_s")
    parts["median_step_s"] = slower * median(live, "steps")  # every step a little slower
    return parts


def _none_of(variant: str) -> str:
    """The run without failures that `variant` is measured against: the same start method."""
    return "none-warm" if variant.endswith("-warm") else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--kills", default="60,120,180", help="steps rank 1 is killed at")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds of compute per step")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--zero-stage", default="0", help="ZeRO stage (1-2: snapshots)")
    parser.add_argument("--width", default="32", help="hidden width of the model")
    parser.add_argument("--depth", default="0", help="hidden layers of width x width")
    parser.add_argument("--nproc", type=int, default=3, help="ranks")
    parser.add_argument("--shard-size", default="", help="stage 3: HSDP's zero3_shard_size")
    parser.add_argument("--offload", default="", choices=("", "disk"), help="zero_offload")
    parser.add_argument("--redundancy", default="", help="live_redundancy k, or a list: 1,2")
    parser.add_argument("--no-failures", action="store_true", help="only none and quiet-live")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="add none-warm, live-warm, restart-warm: --start-method forkserver",
    )
    parser.add_argument("--baseline-tree", type=Path, default=None, help="an older checkout")
    ns = parser.parse_args()
    compile_tree()
    ks = [f"-k{k}" for k in ns.redundancy.split(",") if k] or [""]
    lives = [] if ns.no_failures else [f"live{k}" for k in ks]
    variants = ("none", *[f"quiet-live{k}" for k in ks], *lives)
    variants += () if ns.no_failures else ("restart",)
    if ns.warm:
        variants += ("none-warm",) + (() if ns.no_failures else ("live-warm", "restart-warm"))
    if ns.baseline_tree:
        variants += ("quiet-live-base",) + (() if ns.no_failures else ("live-base",))
    extra = {"ZERO_STAGE": ns.zero_stage, "WIDTH": ns.width, "DEPTH": ns.depth,
             "ZERO3_SHARD_SIZE": ns.shard_size, "ZERO_OFFLOAD": ns.offload}  # fmt: skip
    walls: dict[str, list[float]] = {v: [] for v in variants}
    for round_index in range(ns.rounds):
        for variant in interleave.balanced_order(round_index, variants):
            wall = run_once(variant, ns.steps, ns.kills, ns.save_every, ns.pause, extra,
                            ns.nproc, ns.baseline_tree)  # fmt: skip
            walls[variant].append(wall)
            print(f"round {round_index} {variant:8s} {wall:7.2f} s", flush=True)
    median = {v: statistics.median(w) for v, w in walls.items()}
    rss = {v: statistics.median(m) for v, m in PEAK_RSS_MB.items()}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()}
    figures: dict[str, object] = {"settings": settings,
                                  "walls_s": walls, "median_s": median,
                                  "peak_rss_mb": PEAK_RSS_MB, "held_bytes": HELD_BYTES,
                                  "phases_s": PHASES}  # fmt: skip
    for k in ks:
        cost = median[f"quiet-live{k}"] / median["none"]  # live recovery's own price
        held = HELD_BYTES[f"quiet-live{k}"][-1]
        snap = statistics.median(h["snapshot_s"] for h in HELD_BYTES[f"quiet-live{k}"])
        print(f"no failure{k}: live recovery's wall / a run without it = {cost:.3f}; "
              f"held at most {held['memory'] / 2**20:.1f} MB in memory, "
              f"{held['files'] / 2**20:.1f} MB in files; a snapshot adds {snap:.3f} s "
              "to its step")  # fmt: skip
        figures[f"quiet_live{k.replace('-', '_')}_over_none"] = cost
    if not ns.no_failures:
        warm = ("live-warm", "restart-warm") if ns.warm else ()
        lost = {v: median[v] - median[_none_of(v)] for v in (*lives, "restart", *warm)}
        figures["lost_s"] = lost
        failures = len(ns.kills.split(","))
        for live in (*lives, *warm[:1]):
            restart = "restart-warm" if live.endswith("-warm") else "restart"
            ratio = lost[live] / lost[restart] if lost[restart] > 0 else float("nan")
            print(f"lost to {failures} failures: {live} {lost[live]:.2f} s, {restart} "
                  f"{lost[restart]:.2f} s; {live} / {restart} = {ratio:.3f} "
                  "(target <= 0.1)")  # fmt: skip
            figures[f"{live.replace('-', '_')}_over_restart"] = ratio
            parts = _lost_by_phase(PHASES[live], PHASES[_none_of(live)])
            figures[f"{live.replace('-', '_')}_phases_s"] = parts
            print(f"{live}'s lost seconds by where they went (medians over runs; each step "
                  "less its run's median step; against none): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))  # fmt: skip
    if ns.baseline_tree and not ns.no_failures:
        base_lost = median["live-base"] - median["none"]
        figures["live_base_over_restart"] = base_lost / (median["restart"] - median["none"])
        print(f"baseline: lost to failures {base_lost:.2f} s, live-base / restart = "
              f"{figures['live_base_over_restart']:.3f}")  # fmt: skip
    if ns.baseline_tree:
        figures["quiet_live_base_over_none"] = median["quiet-live-base"] / median["none"]
        snap = statistics.median(h["snapshot_s"] for h in HELD_BYTES["quiet-live-base"])
        print(f"baseline: quiet-live / none = {figures['quiet_live_base_over_none']:.3f}; "
              f"a snapshot adds {snap:.3f} s to its step")  # fmt: skip
    print(f"peak RSS of the largest rank, medians: {rss}")
    if ns.out is not None:
        ns.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
