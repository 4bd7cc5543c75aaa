"""What `phalanx bench` makes of a timeline: the numbers per world size, and its advice.

Imports no torch (the `phalanx` command must start fast): it reads the Chrome
trace that phalanx.diagnostics.timeline merged, and the JSON of the all-reduce
probe. A *step* is the time from the end of one synced backward's final wait
to the end of the next; everything recorded in between (forward, backward,
the wait, the optimizer step, logging) is that step's, and what no span
covers is "other" (data loading, the script's own work).

The step time reported is the slowest rank's median step, and its parts are that
very step's: they add up to it, in the table and in the PNG's stacked bar (parts
that were each a median over steps, averaged over ranks, summed to 24 ms under a
step printed as 31.8).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

PARTS = ("forward", "backward", "exposed", "optimizer", "other")
"""The pieces a step's time is split into, in the order the plot stacks them."""
_SPAN_PART = {
    "forward": "forward",
    "backward": "backward",
    "wait for buckets": "exposed",
    "optimizer step": "optimizer",
}


@dataclass
class WorldResult:
    """One world size's run, every time a median over the measured steps (ms)."""

    world_size: int
    steps: int
    step_ms: float
    samples_per_step: int
    """Over all ranks: the batch dimension of every training forward (0: unknown)."""
    parts_ms: dict[str, float]
    """The parts of the step `step_ms` is the length of: they add up to it."""
    hidden_ms: float
    """Communication that overlapped backward."""
    comm_busy_ms: float
    """Time some bucket was in flight (the union of the flights)."""
    bytes_per_step: int
    buckets_per_step: int
    bucket_bytes: list[int]
    probe_alone_ms: float | None = None
    """The same buckets all-reduced back to back with nothing else running (probe job)."""
    probe_sizes: list[dict[str, float]] = field(default_factory=list)
    """The probe's own curve: bytes -> ms and GB/s, for choosing a bucket size."""
    probe_bf16_hook_ms: float | None = None
    """The bf16 hook averaging the step's bytes alone, conversions included (probe job)."""
    efficiency: float | None = None

    @property
    def throughput(self) -> float:
        """Samples per second (steps per second when the batch size is unknown)."""
        per_step = self.samples_per_step or 1
        return per_step * 1000.0 / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def achieved_gbps(self) -> float | None:
        if self.bytes_per_step == 0 or self.comm_busy_ms <= 0:
            return None
        return self.bytes_per_step / self.comm_busy_ms / 1e6

    @property
    def probe_gbps(self) -> float | None:
        if not self.probe_alone_ms or self.bytes_per_step == 0:
            return None
        return self.bytes_per_step / self.probe_alone_ms / 1e6

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            throughput=self.throughput,
            throughput_unit="samples/s" if self.samples_per_step else "steps/s",
            achieved_allreduce_gbps=self.achieved_gbps,
            probe_allreduce_gbps=self.probe_gbps,
        )
        return data


@dataclass
class Recommendation:
    advice: str
    reason: str


# ------------------------------------------------------------------ one trace
def analyze_trace(trace: dict[str, Any], warmup: int) -> WorldResult:
    """The medians of the steps after `warmup`, the slowest rank setting the step time."""
    ranks = trace.get("phalanx", {}).get("ranks", [])
    per_rank = [_rank_steps(trace, rank, warmup) for rank in ranks]
    per_rank = [steps for steps in per_rank if steps]
    if not per_rank:
        raise ValueError("no measured step in the timeline")
    medians = [{k: statistics.median(s[k] for s in steps) for k in steps[0]} for steps in per_rank]
    slowest = max((_median_step(steps) for steps in per_rank), key=lambda s: s["step"])
    # A world of one sends nothing: its reducer's all-reduce over one rank moves no byte
    # anywhere, and reporting its buckets and bandwidth read as communication.
    sends = len(ranks) > 1
    sizes = _bucket_sizes(trace, ranks[0], warmup) if sends else []
    return WorldResult(
        world_size=len(ranks),
        steps=min(len(steps) for steps in per_rank),
        step_ms=slowest["step"],
        samples_per_step=int(sum(m["samples"] for m in medians)),
        parts_ms={p: slowest[p] for p in PARTS},
        hidden_ms=statistics.mean(m["hidden"] for m in medians) if sends else 0.0,
        comm_busy_ms=statistics.mean(m["busy"] for m in medians) if sends else 0.0,
        bytes_per_step=int(medians[0]["bytes"]) if sends else 0,
        buckets_per_step=len(sizes),
        bucket_bytes=sizes,
    )


def _median_step(steps: list[dict[str, float]]) -> dict[str, float]:
    """The step of median length itself (the lower middle one), so its parts add up."""
    return sorted(steps, key=lambda s: s["step"])[(len(steps) - 1) // 2]


def _events(trace: dict[str, Any], rank: int, tid: int) -> list[dict[str, Any]]:
    found = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
    return sorted((e for e in found if e["tid"] == tid), key=lambda e: e["ts"])


def _step_bounds(compute: list[dict[str, Any]]) -> list[float]:
    """The end of each synced backward's final wait: where one step ends and the next begins."""
    return [e["ts"] + e["dur"] for e in compute if e["name"] == "wait for buckets"]


def _rank_steps(trace: dict[str, Any], rank: int, warmup: int) -> list[dict[str, float]]:
    compute, comm = _events(trace, rank, 0), _events(trace, rank, 1)
    ends = _step_bounds(compute)
    records = trace["phalanx"]["steps"].get(str(rank), [])
    steps = []
    for k in range(max(1, warmup), min(len(ends), len(records))):
        lo, hi = ends[k - 1], ends[k]
        parts = dict.fromkeys(PARTS, 0.0)
        for e in compute:
            if lo <= e["ts"] < hi and e["name"] in _SPAN_PART:
                # Cut at the step's end: a span running past it would make the parts
                # add up to more than the step.
                parts[_SPAN_PART[e["name"]]] += (min(e["ts"] + e["dur"], hi) - e["ts"]) / 1000
        step = (hi - lo) / 1000
        parts["other"] = max(0.0, step - sum(parts.values()))
        flights = [(e["ts"], e["ts"] + e["dur"]) for e in comm if lo < e["ts"] <= hi]
        steps.append(
            {
                **parts,
                "step": step,
                "samples": records[k]["samples"],
                "hidden": records[k]["hidden_ms"],
                "bytes": records[k]["bytes"],
                "busy": _union_us(flights) / 1000,
            }
        )
    return steps


def _bucket_sizes(trace: dict[str, Any], rank: int, warmup: int) -> list[int]:
    """Bytes of each bucket of the last measured step (after the one-time rebuild)."""
    compute, comm = _events(trace, rank, 0), _events(trace, rank, 1)
    ends = _step_bounds(compute)
    if len(ends) < 2 or len(ends) <= warmup:
        return []
    lo, hi = ends[-2], ends[-1]
    return [int(e["args"].get("bytes", 0)) for e in comm if lo < e["ts"] <= hi]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# ------------------------------------------------------------------ the probe
def attach_probe(result: WorldResult, probe: dict[str, Any]) -> None:
    """The probe's times for this job's buckets (alone, back to back) and its size curve."""
    timed = {int(p["bytes"]): float(p["ms"]) for p in probe["sizes"]}
    if result.bucket_bytes and all(b in timed for b in result.bucket_bytes):
        result.probe_alone_ms = sum(timed[b] for b in result.bucket_bytes)
    curve = sorted(timed.items())
    result.probe_sizes = [{"bytes": b, "ms": ms, "gbps": b / ms / 1e6} for b, ms in curve if ms]
    hook = probe.get("bf16_hook")
    if hook and int(hook["bytes"]) == result.bytes_per_step:
        result.probe_bf16_hook_ms = float(hook["ms"])


def set_efficiency(results: list[WorldResult]) -> None:
    """thr_N / (N/N0 x thr_N0), N0 the smallest world measured (ideally 1)."""
    if not results:
        return
    base = min(results, key=lambda r: r.world_size)
    for r in results:
        scale = r.world_size / base.world_size
        r.efficiency = r.throughput / (scale * base.throughput) if base.throughput else None
