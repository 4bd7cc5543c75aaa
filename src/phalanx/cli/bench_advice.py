"""`phalanx bench`'s advice: each recommendation computed from the measurements, with why.

The rules look at the largest world measured, where communication matters
most, and compare with the smallest. Thresholds and where they come from:

- exposed communication under 5% of the step: nothing to win from settings;
- compute per sample more than 25% above the smallest world's: the ranks
  slow each other down (shared cores or memory bandwidth), which no DDP
  setting fixes;
- a bucket size whose all-reduce reaches 80% of the best bandwidth the probe
  measured: smaller buckets overlap sooner, larger ones waste no bandwidth;
- gradient accumulation sized so the exposed time per micro-batch falls
  under 5% of compute, at most 8 micro-batches (a larger batch changes the
  training, not only its speed).
"""

from __future__ import annotations

import itertools
import math

from phalanx.cli.bench_report import Recommendation, WorldResult

QUIET = 0.05  # exposed share of the step below which communication is not the problem
CONTENTION = 1.25  # compute per sample this much above the base world: ranks slow each other
NEAR_BEST = 0.8  # a bucket size is "fast enough" at this share of the best probe bandwidth
MB = 1 << 20
MAX_ACCUMULATION = 8  # beyond this the batch changes too much to suggest without a reason


def recommend(
    results: list[WorldResult], threads: int | None = None, cores: int | None = None
) -> list[Recommendation]:
    """What to change, each with the numbers that say so. `threads`: OMP_NUM_THREADS per
    rank, `cores`: the machine's (None: unknown), for advice about threads."""
    if not results:
        return []
    top = max(results, key=lambda r: r.world_size)
    base = min(results, key=lambda r: r.world_size)
    if top.world_size == 1:
        return [_measure_more_worlds(top)]
    advice: list[Recommendation] = []
    contention = _contention(base, top)
    if contention is not None:
        advice.append(contention)
    exposed = top.parts_ms["exposed"]
    share = exposed / top.step_ms if top.step_ms else 0.0
    if share < QUIET:
        if contention is None:
            advice.append(_scale_freely(top, share))
        return advice
    for rule in (_bucket_size, _comm_hook, _accumulate):
        found = rule(top, share)
        if found is not None:
            advice.append(found)
    slow = _slow_collective(top, threads, cores)
    return advice + ([slow] if slow is not None else [])


def _measure_more_worlds(top: WorldResult) -> Recommendation:
    """One rank sends nothing: its figures say nothing about scaling out."""
    return Recommendation(
        "measure more than one world size, e.g. --nproc 1,2",
        f"world {top.world_size} alone sends nothing to another rank, so its "
        f"{top.step_ms:.1f} ms step says nothing about communication or scaling",
    )


def _compute_ms(r: WorldResult) -> float:
    return r.parts_ms["forward"] + r.parts_ms["backward"] + r.parts_ms["optimizer"]


def _scale_freely(top: WorldResult, share: float) -> Recommendation:
    eff = f", scaling efficiency {top.efficiency:.0%}" if top.efficiency is not None else ""
    return Recommendation(
        "this model is compute-bound: scale out freely",
        f"at world {top.world_size} only {top.parts_ms['exposed']:.1f} ms of a "
        f"{top.step_ms:.1f} ms step ({share:.0%}) waits for communication{eff}",
    )


def _contention(base: WorldResult, top: WorldResult) -> Recommendation | None:
    """Compute per sample grew with the world: the ranks compete for the machine."""
    if base is top or not base.samples_per_step or not top.samples_per_step:
        return None
    per_base = _compute_ms(base) / (base.samples_per_step / base.world_size)
    per_top = _compute_ms(top) / (top.samples_per_step / top.world_size)
    if per_top < CONTENTION * per_base:
        return None
    return Recommendation(
        "more ranks on this machine will not help: add machines or devices, not processes",
        f"compute per sample is {per_top / per_base:.2f}x at world {top.world_size} what it "
        f"is at world {base.world_size} ({per_top * 1000:.1f} vs {per_base * 1000:.1f} us): "
        "the ranks slow each other down (shared cores or memory bandwidth), whatever DDP does",
    )


def _good_bucket_bytes(top: WorldResult) -> int | None:
    """The smallest probed size that reaches NEAR_BEST of the best probed bandwidth."""
    if not top.probe_sizes:
        return None
    best = max(p["gbps"] for p in top.probe_sizes)
    return min(int(p["bytes"]) for p in top.probe_sizes if p["gbps"] >= NEAR_BEST * best)


def _bucket_size(top: WorldResult, share: float) -> Recommendation | None:
    good = _good_bucket_bytes(top)
    if good is None or not top.bucket_bytes:
        return None
    mean = sum(top.bucket_bytes) / len(top.bucket_bytes)
    cap = max(1, math.ceil(min(good, top.bytes_per_step) / MB))
    if top.buckets_per_step <= 2 and top.bytes_per_step > 2 * good:
        return Recommendation(
            f"smaller buckets: bucket_cap_mb={cap}",
            f"{top.bytes_per_step / MB:.1f} MB go in {top.buckets_per_step} bucket(s), so "
            f"only {top.hidden_ms:.1f} ms of communication hides behind backward; the probe "
            f"reaches {NEAR_BEST:.0%} of its best bandwidth from {good / MB:.1f} MB messages",
        )
    if top.buckets_per_step > 1 and mean < good / 2:
        return Recommendation(
            f"larger buckets: bucket_cap_mb={cap}",
            f"the mean bucket is {mean / MB:.2f} MB; the probe's all-reduce needs "
            f"{good / MB:.1f} MB messages for {NEAR_BEST:.0%} of its best bandwidth",
        )
    return None


def _slow_collective(
    top: WorldResult, threads: int | None, cores: int | None
) -> Recommendation | None:
    """The buckets took far longer in training than alone: they compete with compute. With
    the threads and cores known, a thread count that leaves each rank a core for its
    collective; none when one thread per rank is already all there is to take away."""
    achieved, alone = top.achieved_gbps, top.probe_gbps
    if achieved is None or alone is None or achieved > 0.6 * alone:
        return None
    why = (
        f"the step's all-reduces ran at {achieved:.2f} GB/s during training against "
        f"{alone:.2f} GB/s alone (probe): {top.comm_busy_ms:.1f} ms in flight instead of "
        f"{top.probe_alone_ms:.1f} ms, because backward and the collective share the cores"
    )
    if threads is None or cores is None:
        return Recommendation(
            "give communication room: fewer compute threads per rank (OMP_NUM_THREADS), "
            "or a device that computes apart from the CPU",
            why,
        )
    fewer = max(1, (cores - top.world_size) // top.world_size)
    if fewer >= threads:
        return None  # nothing to take away: the contention advice says what is left
    return Recommendation(
        f"give communication room: OMP_NUM_THREADS={fewer} per rank",
        f"{why}; {top.world_size} ranks of {threads} threads fill the {cores} cores, "
        f"{fewer} threads per rank leave each rank a core for its collective",
    )


def _probe_ms(top: WorldResult, nbytes: float) -> float | None:
    """The probe's all-reduce time at `nbytes`, interpolated on log-log between sizes."""
    curve = [(p["bytes"], p["ms"]) for p in top.probe_sizes if p["ms"] > 0]
    if len(curve) < 2 or not curve[0][0] <= nbytes <= curve[-1][0]:
        return None
    for (b0, t0), (b1, t1) in itertools.pairwise(curve):
        if b0 <= nbytes <= b1:
            w = math.log(nbytes / b0) / math.log(b1 / b0) if b1 > b0 else 0.0
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return None


def _comm_hook(top: WorldResult, share: float) -> Recommendation | None:
    """Compression helps as much as the probe says the bf16 hook, conversions included,
    beats the plain all-reduce of the same gradients (on a CPU it may not)."""
    exposed, nbytes = top.parts_ms["exposed"], top.bytes_per_step
    full, hooked = _probe_ms(top, nbytes), top.probe_bf16_hook_ms
    if full is None or hooked is None or full <= 0:
        return None
    saving = exposed * max(0.0, 1 - hooked / full)
    if saving < QUIET * top.step_ms:
        return None
    return Recommendation(
        "a compression hook: model.register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)",
        f"{exposed:.1f} ms of the {top.step_ms:.1f} ms step ({share:.0%}) waits for "
        f"{nbytes / MB:.1f} MB of gradients; the probe averages them through the bf16 hook "
        f"(conversions included) in {hooked:.1f} ms instead of {full:.1f} ms, so bf16 saves "
        f"about {saving:.1f} ms per step",
    )


def _accumulate(top: WorldResult, share: float) -> Recommendation | None:
    exposed, compute = top.parts_ms["exposed"], _compute_ms(top)
    if share < 2 * QUIET or compute <= 0:
        return None
    needed = max(2, math.ceil(exposed / (QUIET * compute)))
    k = min(MAX_ACCUMULATION, needed)
    reason = (
        f"the exposed {exposed:.1f} ms is paid once per synced step; over {k} micro-batches "
        f"of {compute:.1f} ms compute it falls to {exposed / k:.1f} ms each "
        f"({exposed / k / compute:.0%} of compute)"
    )
    if needed > MAX_ACCUMULATION:
        reason += (
            f", still above {QUIET:.0%}: it would take {needed}, a batch too much larger "
            "to suggest; communication stays this step's limit"
        )
    return Recommendation(
        f"gradient accumulation: gradient_accumulation_steps={k} (no_sync() for k-1 of k "
        "micro-batches; the optimizer then sees a k times larger batch: retune the rate)",
        reason,
    )
