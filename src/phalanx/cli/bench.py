"""`phalanx bench [--nproc 1,2,4] [--steps N] script.py [args]`: should you scale out, and how?

Runs the script under `phalanx launch` once per world size with the timeline
on (PHALANX_TIMELINE), stops it after warm-up + N synced steps
(PHALANX_BENCH_STEPS: the script exits cleanly at its next forward), and
reads the merged timeline: throughput, scaling efficiency, where each step's
time went, exposed and hidden communication, bytes per step. A probe job
then times the same all-reduces alone, so the bandwidth the step achieved
stands next to what the collective can do here. Advice follows, each line
with its reason (phalanx.cli.bench_advice). The report is printed and
written as JSON and PNG. Imports no torch: the jobs do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.cli.bench_advice import recommend
from phalanx.cli.bench_plot import plot_breakdown
from phalanx.cli.bench_report import (
    PARTS,
    Recommendation,
    WorldResult,
    analyze_trace,
    attach_probe,
    set_efficiency,
)
from phalanx.errors import ConfigurationError

_TIMELINE = "PHALANX_TIMELINE"
_STOP = "PHALANX_BENCH_STEPS"
# Probe sizes besides the job's own buckets: 256 KiB to 64 MiB by factors of 4, the
# range of bucket_cap_mb worth recommending, as far as the step's bytes reach.
_PROBE_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def probe_sizes(result: WorldResult) -> list[int]:
    """The job's buckets, the whole step, and the standard sizes up to the step's bytes
    (no bucket is larger)."""
    step = result.bytes_per_step
    standard = [n for n in _PROBE_SIZES if n <= step]
    return sorted({*result.bucket_bytes, step, *standard} - {0})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx bench",
        usage="phalanx bench [--nproc 1,2,4] [--steps N] script.py [script args]",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    parser.add_argument("--nproc", default="1,2", help="world sizes to run, e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per world size")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="report directory")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS per rank, the same in every world; default: yours, or, "
        "when unset, cores / the largest world",
    )
    parser.add_argument("--no-probe", action="store_true", help="skip the all-reduce probe")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("script", help="the training script (phalanx DDP or Trainer)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def parse_worlds(text: str) -> list[int]:
    try:
        worlds = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        worlds = []
    if not worlds or worlds[0] < 1:
        raise ConfigurationError(f"--nproc {text!r} is not a list of world sizes — e.g. 1,2,4")
    return worlds


def bench_main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        worlds = parse_worlds(ns.nproc)
        if not Path(ns.script).is_file():
            raise ConfigurationError(f"script {ns.script!r} not found — check the path")
        if ns.steps < 2 or ns.warmup < 1:
            raise ConfigurationError("--steps must be >= 2 and --warmup >= 1 — e.g. --steps 20")
        report = run_bench(ns, worlds)
    except ConfigurationError as exc:
        print(f"phalanx bench: error: {exc}", file=sys.stderr, flush=True)
        return 1
    text = render(report)
    print(text)
    write_outputs(report, text, ns.out)
    return 0


def run_bench(ns: argparse.Namespace, worlds: list[int]) -> dict[str, Any]:
    ns.out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    threads = threads_per_rank(ns.threads, os.environ, worlds, cores)
    results = []
    for world in worlds:
        print(f"phalanx bench: world {world}: running {ns.script} ...", flush=True)
        result = _measure(ns, world, threads)
        if world > 1 and not ns.no_probe and result.bucket_bytes:
            attach_probe(result, _probe(ns, world, result, threads))
        results.append(result)
    set_efficiency(results)
    advice = recommend(results, int(threads) if threads.isdigit() else None, cores)
    return {
        "script": ns.script,
        "script_args": ns.script_args,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "threads_per_rank": threads,
        "worlds": [r.to_dict() for r in results],
        "recommendations": [{"advice": a.advice, "reason": a.reason} for a in advice],
        "warnings": measurement_warnings(results),
        "_results": results,
        "_advice": advice,
    }


def threads_per_rank(
    flag: int | None, environ: Mapping[str, str], worlds: list[int], cores: int
) -> str:
    """OMP_NUM_THREADS for every rank of every world: the flag, the user's own, or the
    cores' share of the largest world's ranks.

    The same in every world, so that efficiency compares like with like: cores /
    ranks per world gave world 1 two threads and each world-2 rank one, and the
    report called that 5045% efficiency. (More threads than cores starve gloo's.)
    """
    if flag is not None:
        return str(flag)
    return environ.get("OMP_NUM_THREADS") or str(max(1, cores // max(worlds)))


def measurement_warnings(results: list[WorldResult]) -> list[str]:
    """An efficiency above 100% is no speed-up but a sign the runs differed in more than
    their world size; the report says so instead of printing it as a result."""
    return [
        f"world {r.world_size}'s scaling efficiency of {r.efficiency:.0%} is above 100%: a "
        "measurement problem, not a speed-up (the runs differed in more than the world "
        "size: the machine's other load, threads, caches) — rerun on an idle machine, "
        "with more --steps"
        for r in results
        if r.efficiency is not None and r.efficiency > 1.0
    ]


def _env(threads: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": threads}


def _launch(
    ns: argparse.Namespace, world: int, target: list[str], log: Path, env: dict[str, str]
) -> None:
    argv = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", str(world), *target]
    with log.open("w") as out:
        try:
            code = subprocess.run(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=ns.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise ConfigurationError(
            f"world {world}: {target[0]} exited with {code} — see {log}; its end:\n{tail}"
        )


def _measure(ns: argparse.Namespace, world: int, threads: str) -> WorldResult:
    trace_path = ns.out / f"timeline-w{world}.json"
    trace_path.unlink(missing_ok=True)
    env = _env(threads)
    env[_TIMELINE] = str(trace_path.resolve())
    env[_STOP] = str(ns.warmup + ns.steps)
    _launch(ns, world, [ns.script, *ns.script_args], ns.out / f"world-{world}.log", env)
    if not trace_path.exists():
        raise ConfigurationError(
            f"world {world}: the script wrote no timeline — it must train through "
            "phalanx.DistributedDataParallel or phalanx.Trainer"
        )
    trace = json.loads(trace_path.read_text())
    try:
        return analyze_trace(trace, ns.warmup)
    except ValueError:
        raise ConfigurationError(
            f"world {world}: the script ran fewer than {ns.warmup + 2} synced steps — "
            "let it run longer, or lower --warmup"
        ) from None


def _probe(ns: argparse.Namespace, world: int, result: WorldResult, threads: str) -> dict[str, Any]:
    """All-reduce times of the probe sizes, and the bf16 hook on the step's bytes (what
    compression would cost, conversions included), with nothing else running."""
    out = ns.out / f"probe-w{world}.json"
    target = [
        "-m",
        "phalanx.ddp.allreduce_probe",
        "--sizes",
        ",".join(map(str, probe_sizes(result))),
        "--bf16-hook-bytes",
        str(result.bytes_per_step),
        "--out",
        str(out.resolve()),
    ]
    env = _env(threads)
    env.pop(_TIMELINE, None)
    _launch(ns, world, target, ns.out / f"probe-w{world}.log", env)
    return dict(json.loads(out.read_text()))


# -------------------------------------------------------------------- output
def render(report: dict[str, Any]) -> str:
    results: list[WorldResult] = report["_results"]
    advice: list[Recommendation] = report["_advice"]
    unit = "samples/s" if all(r.samples_per_step for r in results) else "steps/s"
    lines = [
        f"phalanx bench: {report['script']}  ({report['steps']} steps after "
        f"{report['warmup']} warm-up, medians; ms per step; OMP_NUM_THREADS="
        f"{report['threads_per_rank']} per rank in every world)",
        "",
        f"{'world':>5} {'step':>8} {unit:>10} {'effic.':>6}  "
        + " ".join(f"{p:>9}" for p in PARTS)
        + f" {'hidden':>7} {'MB/step':>8} {'buckets':>7} {'GB/s':>6} {'alone':>6}",
    ]
    for r in results:
        eff = f"{r.efficiency:.0%}" if r.efficiency is not None else "-"
        lines.append(
            f"{r.world_size:>5} {r.step_ms:>8.2f} {r.throughput:>10.1f} {eff:>6}  "
            + " ".join(f"{r.parts_ms[p]:>9.2f}" for p in PARTS)
            + _comm_cells(r)
        )
    lines += [
        "",
        "exposed: the end of backward waiting for buckets; hidden: bucket flight inside "
        "backward; GB/s: the step's all-reduce bandwidth in training, alone: the same "
        "all-reduces with nothing else running (probe); '-' at world 1: nothing is sent",
        "",
    ]
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [""] if report["warnings"] else []
    lines += ["recommendations:"]
    lines += [f"- {a.advice}\n    because {a.reason}" for a in advice] or ["- none"]
    return "\n".join(lines)


def _comm_cells(r: WorldResult) -> str:
    """hidden, MB/step, buckets, GB/s and alone: dashes where one rank sends nothing."""
    if r.world_size == 1:
        return f" {'-':>7} {'-':>8} {'-':>7} {'-':>6} {'-':>6}"
    return (
        f" {r.hidden_ms:>7.2f} {r.bytes_per_step / 2**20:>8.2f} {r.buckets_per_step:>7}"
        f" {_gbps(r.achieved_gbps):>6} {_gbps(r.probe_gbps):>6}"
    )


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_outputs(report: dict[str, Any], text: str, out: Path) -> None:
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    (out / "bench.json").write_text(json.dumps(public, indent=1))
    (out / "bench.txt").write_text(text + "\n")
    note = plot_breakdown(report["_results"], out / "bench.png")
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.txt'}" + (f", {note}" if note else ""))
