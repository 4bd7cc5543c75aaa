"""`phalanx bench`'s arithmetic and advice on made-up timelines, without processes."""

from __future__ import annotations

import re
from typing import Any

import pytest

from phalanx.cli.bench import measurement_warnings, render, threads_per_rank
from phalanx.cli.bench_advice import recommend
from phalanx.cli.bench_report import WorldResult, analyze_trace, attach_probe, set_efficiency

MB = 1 << 20


def _x(rank: int, tid: int, name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": rank, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(steps: int, period_us: float = 10_000, world: int = 2) -> dict[str, Any]:
    """`world` ranks alike; each step: forward 2 ms, backward 4 ms (two buckets), wait
    1 ms, opt 1 ms."""
    events, records = [], []
    for k in range(steps):
        t = k * period_us
        for rank in range(world):
            events += [
                _x(rank, 0, "forward", t, 2000, samples=16),
                _x(rank, 0, "backward", t + 2000, 4000),
                _x(rank, 1, "bucket 0", t + 3000, 2000, bytes=MB),  # inside backward
                _x(rank, 1, "bucket 1", t + 4000, 3000, bytes=MB),  # overlaps the first
                _x(rank, 0, "wait for buckets", t + 6000, 1000),
                _x(rank, 0, "optimizer step", t + 7000, 1000),
            ]
        records.append({"samples": 16, "hidden_ms": 3.0, "bytes": 2 * MB})
    steps_of = {str(rank): records for rank in range(world)}
    return {"traceEvents": events, "phalanx": {"ranks": list(range(world)), "steps": steps_of}}


def test_a_step_runs_from_one_final_wait_to_the_next_and_splits_into_its_spans() -> None:
    result = analyze_trace(_trace(5), warmup=1)
    assert result.steps == 4 and result.step_ms == pytest.approx(10.0)
    # The optimizer step after wait k belongs to step k + 1: every period holds one of each.
    assert result.parts_ms == pytest.approx(
        {"forward": 2.0, "backward": 4.0, "exposed": 1.0, "optimizer": 1.0, "other": 2.0}
    )
    assert result.comm_busy_ms == pytest.approx(4.0)  # union of [3, 5] and [4, 7] ms
    assert result.bucket_bytes == [MB, MB] and result.bytes_per_step == 2 * MB
    assert result.throughput == pytest.approx(3200.0)  # 16 samples per rank per 10 ms
    assert result.achieved_gbps == pytest.approx(2 * MB / 4.0 / 1e6)


def test_too_few_steps_is_an_error_bench_can_name() -> None:
    with pytest.raises(ValueError):
        analyze_trace(_trace(2), warmup=3)


def test_probe_times_the_same_buckets_alone_and_efficiency_is_per_rank_throughput() -> None:
    result = analyze_trace(_trace(4), warmup=1)
    attach_probe(result, {"sizes": [{"bytes": MB, "ms": 0.5}, {"bytes": 4 * MB, "ms": 1.0}]})
    assert result.probe_alone_ms == pytest.approx(1.0)
    one = _result(1, step=10.0, exposed=0.0)
    two = _result(2, step=10.0, exposed=0.0)
    set_efficiency([one, two])
    assert two.efficiency == pytest.approx(0.5)  # same throughput from twice the ranks


def _result(world: int, step: float, exposed: float, **kw: Any) -> WorldResult:
    compute = (step - exposed) / 3
    fields: dict[str, Any] = {
        "world_size": world, "steps": 10, "step_ms": step, "samples_per_step": 64,
        "parts_ms": {"forward": compute, "backward": compute, "exposed": exposed,
                     "optimizer": compute, "other": 0.0},
        "hidden_ms": 0.0, "comm_busy_ms": exposed, "bytes_per_step": 32 * MB,
        "buckets_per_step": 2, "bucket_bytes": [7 * MB, 25 * MB],
    }  # fmt: skip
    fields.update(kw)
    return WorldResult(**fields)


_CURVE = [
    {"bytes": b * MB, "ms": ms, "gbps": b * MB / ms / 1e6}
    for b, ms in ((1, 4.0), (4, 5.0), (16, 8.0), (64, 30.0))
]


def _advice(results: list[WorldResult]) -> str:
    return " | ".join(a.advice for a in recommend(results))


def test_little_exposed_communication_means_scale_out_freely() -> None:
    assert "scale out freely" in _advice([_result(1, 10, 0), _result(2, 5.2, 0.2)])


def test_compute_slower_per_sample_at_more_ranks_is_called_contention() -> None:
    # Same global batch: world 2 should compute half as long per rank, not as long.
    advice = _advice([_result(1, 10, 0), _result(2, 10, 0.2)])
    assert "will not help" in advice and "scale out freely" not in advice


def test_one_big_bucket_gets_smaller_buckets_from_the_probe_curve() -> None:
    top = _result(2, 5.0, 2.0, buckets_per_step=1, bucket_bytes=[64 * MB],
                  bytes_per_step=64 * MB, probe_sizes=_CURVE)  # fmt: skip
    # 16 MB reaches 2.1 GB/s, the best is 2.2 (64 MB): >= 80% -> 16 MB.
    assert "smaller buckets: bucket_cap_mb=16" in _advice([_result(1, 6, 0), top])


def test_many_small_buckets_get_larger_ones() -> None:
    top = _result(2, 5.0, 2.0, buckets_per_step=32, bucket_bytes=[MB] * 32, probe_sizes=_CURVE)
    assert "larger buckets: bucket_cap_mb=16" in _advice([_result(1, 6, 0), top])


def test_a_collective_slower_in_training_than_alone_is_shown_with_both_speeds() -> None:
    top = _result(2, 5.0, 2.0, comm_busy_ms=20.0, probe_alone_ms=8.0)
    advice = recommend([_result(1, 6, 0), top])
    slow = [a for a in advice if "room" in a.advice]
    assert slow and "alone" in slow[0].reason and "20.0 ms" in slow[0].reason


def test_compression_is_advised_only_where_the_bf16_hook_beats_the_all_reduce() -> None:
    curve = [{"bytes": b * MB, "ms": ms, "gbps": 0.0} for b, ms in ((1, 1.0), (64, 64.0))]
    step = _result(2, 5.0, 2.0).bytes_per_step
    full = step / MB  # the curve's ms at the step's bytes
    # A link-bound collective: the hook, conversions included, takes half the time.
    bound = _result(2, 5.0, 2.0, probe_sizes=curve, probe_bf16_hook_ms=full / 2)
    advice = [a for a in recommend([_result(1, 6, 0), bound]) if "compression" in a.advice]
    assert advice and "conversions included" in advice[0].reason
    assert f"in {full / 2:.1f} ms instead of {full:.1f} ms" in advice[0].reason
    # Loopback on a CPU: converting costs more than the halved copy saves (1.13x measured).
    dearer = _result(2, 5.0, 2.0, probe_sizes=curve, probe_bf16_hook_ms=full * 1.13)
    assert "compression hook" not in _advice([_result(1, 6, 0), dearer])
    unprobed = _result(2, 5.0, 2.0, probe_sizes=curve)  # an old probe file: no hook time
    assert "compression hook" not in _advice([_result(1, 6, 0), unprobed])


def test_the_probes_hook_time_is_kept_only_for_this_steps_bytes() -> None:
    probe = {"sizes": [{"bytes": MB, "ms": 1.0}], "bf16_hook": {"bytes": 2 * MB, "ms": 0.7}}
    result = _result(2, 5.0, 2.0, bytes_per_step=2 * MB, bucket_bytes=[MB])
    attach_probe(result, probe)
    assert result.probe_bf16_hook_ms == 0.7
    other = _result(2, 5.0, 2.0, bytes_per_step=4 * MB, bucket_bytes=[MB])
    attach_probe(other, probe)
    assert other.probe_bf16_hook_ms is None


def test_accumulation_is_sized_to_bring_exposed_time_under_five_percent_of_compute() -> None:
    top = _result(2, 7.0, 1.0)  # compute 6 ms: 1 / (0.05 * 6) -> 4 micro-batches
    assert "gradient_accumulation_steps=4" in _advice([_result(1, 12, 0), top])


def _varied_trace() -> dict[str, Any]:
    """Two ranks whose steps differ in how they split (forward, backward, wait in ms):
    the medians of the parts, averaged over ranks, add up to no step at all."""
    splits = {0: [(6, 1, 1), (1, 6, 1), (1, 1, 6), (2, 2, 2)], 1: [(1, 1, 1), (5, 5, 1)]}
    events, steps = [], {}
    for rank, parts in splits.items():
        t, records = 0.0, []
        for fwd, bwd, wait in [(1, 1, 1), *parts]:  # the first step is warm-up
            events += [
                _x(rank, 0, "forward", t, fwd * 1000, samples=8),
                _x(rank, 0, "backward", t + fwd * 1000, bwd * 1000),
                _x(rank, 1, "bucket 0", t + fwd * 1000, bwd * 1000, bytes=MB),
                _x(rank, 0, "wait for buckets", t + (fwd + bwd) * 1000, wait * 1000),
            ]
            t += (fwd + bwd + wait + 1) * 1000  # 1 ms of "other" after each wait
            records.append({"samples": 8, "hidden_ms": 0.0, "bytes": MB})
        steps[str(rank)] = records
    return {"traceEvents": events, "phalanx": {"ranks": [0, 1], "steps": steps}}


def test_the_parts_of_a_step_add_up_to_the_step_printed_and_plotted() -> None:
    """The PNG stacks parts_ms under the printed step_ms: 24 ms of bars under 31.8."""
    result = analyze_trace(_varied_trace(), warmup=1)
    assert sum(result.parts_ms.values()) == pytest.approx(result.step_ms)
    # Rank 0's steps take 9, 9, 9 and 7 ms, rank 1's 4 and 12: rank 0's median step (9 ms)
    # is the slower, and its parts are reported. (The medians of the parts averaged over
    # the ranks came to 6.75 ms.)
    assert result.step_ms == pytest.approx(9.0)
    assert result.parts_ms["forward"] == pytest.approx(6.0)
    assert result.parts_ms["other"] == pytest.approx(1.0)


def test_every_world_gets_the_same_threads_per_rank() -> None:
    """With OMP_NUM_THREADS unset, cores / ranks gave world 1 two threads and each
    world-2 rank one (5045% 'efficiency'); now every world gets the largest world's share."""
    assert threads_per_rank(None, {}, [1, 2], cores=2) == "1"
    assert threads_per_rank(None, {}, [1, 2, 4], cores=16) == "4"
    assert threads_per_rank(None, {}, [1, 8], cores=2) == "1"
    assert threads_per_rank(None, {"OMP_NUM_THREADS": "3"}, [1, 2], cores=2) == "3"
    assert threads_per_rank(2, {"OMP_NUM_THREADS": "3"}, [1, 2], cores=2) == "2"


def test_an_efficiency_above_100_percent_is_reported_as_a_measurement_problem() -> None:
    one, two, four = _result(1, 10.0, 0.0), _result(2, 4.0, 0.0), _result(4, 4.0, 0.0)
    set_efficiency([one, two, four])
    assert two.efficiency == pytest.approx(1.25)
    warnings = measurement_warnings([one, two, four])
    assert len(warnings) == 1
    assert warnings[0].startswith("world 2's scaling efficiency of 125% is above 100%: a ")
    assert "measurement problem" in warnings[0]
    report = {"script": "s.py", "steps": 10, "warmup": 3, "threads_per_rank": "1",
              "warnings": warnings, "_results": [one, two, four], "_advice": []}  # fmt: skip
    text = render(report)
    assert f"warning: {warnings[0]}" in text
    assert "OMP_NUM_THREADS=1 per rank in every world" in text


def test_a_world_of_one_reports_no_buckets_and_no_bandwidth() -> None:
    """One rank sends nothing: its reducer's all-reduce over itself showed 1 bucket,
    0.10 MB and 35.73 GB/s on the world-1 row."""
    one = analyze_trace(_trace(5, world=1), warmup=1)
    assert (one.buckets_per_step, one.bucket_bytes, one.bytes_per_step) == (0, [], 0)
    assert one.achieved_gbps is None and one.hidden_ms == 0.0
    assert one.parts_ms["exposed"] == pytest.approx(1.0)  # the wait itself is still time
    two = analyze_trace(_trace(5), warmup=1)
    report = {"script": "s.py", "steps": 4, "warmup": 1, "threads_per_rank": "1"}
    report.update(warnings=[], _results=[one, two], _advice=[])
    rows = {line.split()[0]: line.split() for line in render(report).splitlines()[3:5]}
    assert rows["1"][-5:] == ["-"] * 5
    assert rows["2"][-4:-2] == ["2.00", "2"]  # MB/step, buckets


def test_one_world_measured_asks_for_another_instead_of_judging_scaling() -> None:
    """'scale out freely' from world 1 alone did not follow: nothing there is sent."""
    advice = recommend([_result(1, 10, 0.5)])
    assert [a.advice for a in advice] == ["measure more than one world size, e.g. --nproc 1,2"]


def test_fewer_threads_are_advised_only_where_there_are_threads_to_take_away() -> None:
    """With one thread per rank and as many ranks as cores, 'fewer compute threads per
    rank' could not be followed; with threads to spare the advice names the number."""
    top = _result(2, 5.0, 2.0, comm_busy_ms=20.0, probe_alone_ms=8.0)
    none_left = recommend([_result(1, 6, 0), top], threads=1, cores=2)
    assert not [a for a in none_left if "room" in a.advice]
    spare = [
        a for a in recommend([_result(1, 6, 0), top], threads=8, cores=16) if "room" in a.advice
    ]
    assert spare[0].advice == "give communication room: OMP_NUM_THREADS=7 per rank"
    assert "2 ranks of 8 threads fill the 16 cores" in spare[0].reason


def test_accumulation_capped_says_it_does_not_reach_its_target() -> None:
    top = _result(2, 7.0, 4.0)  # compute 3 ms: 4 / (0.05 * 3) -> 27 micro-batches
    (accumulate,) = [a for a in recommend([_result(1, 6, 0), top]) if "accumulation" in a.advice]
    assert "gradient_accumulation_steps=8" in accumulate.advice
    assert "still above 5%: it would take 27" in accumulate.reason


def test_contention_prints_the_per_sample_figures_its_ratio_comes_from() -> None:
    """'1.89x ... (11 vs 6 us)': the rounded figures gave 1.83; one decimal keeps them apart."""
    results = [_result(1, 10, 0, samples_per_step=1600), _result(2, 10, 0.2, samples_per_step=1600)]
    (contention,) = [a for a in recommend(results) if "will not help" in a.advice]
    found = re.search(r"is ([0-9.]+)x .*\(([0-9.]+) vs ([0-9.]+) us\)", contention.reason)
    assert found, contention.reason
    ratio, per_top, per_base = found.groups()
    assert float(per_top) / float(per_base) == pytest.approx(float(ratio), abs=0.01)
