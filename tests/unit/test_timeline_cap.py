"""The timeline's in-memory record is capped (issue 24): past MAX_SPANS spans and MAX_STEPS
step records a rank counts what it drops instead of keeping it, and says how many.

Before: the spans stopped at their cap, but every synced step still appended its record
(its collectives' flights): about 2.3 KB a step, without bound.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from phalanx.diagnostics import timeline
from phalanx.diagnostics.timeline import MAX_SPANS, MAX_STEPS, BenchStop, Timeline


def _step(tl: Timeline, buckets: int = 4) -> None:
    """One synced step as DDP records it: a forward, the buckets' flights, the wait."""
    with tl.forward(8):
        pass
    tl.backward_started()
    for index in range(buckets):
        tl.bucket_launched(index, 1 << 20, None)
    now = time.perf_counter_ns()
    tl.backward_waited(now, now + 1000)


def _growth(tl: Timeline, steps: int) -> int:
    """Bytes the record grew by over `steps` more steps."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(steps):
            _step(tl)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_spans_past_the_cap_are_counted_not_kept(tmp_path: Path) -> None:
    tl = Timeline(tmp_path / "trace.json", 0, 1)
    for k in range(MAX_SPANS + 1234):
        tl.add("span", "compute", k, k + 1)
    assert len(tl.spans) == MAX_SPANS and tl.dropped_spans == 1234


def test_steps_past_both_caps_cost_no_memory_and_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tl = Timeline(tmp_path / "trace.json", 0, 1)
    per_step_spans = 7  # forward, 4 buckets, backward, wait
    steps = max(MAX_STEPS, MAX_SPANS // per_step_spans + 1)
    for _ in range(steps):
        _step(tl)
    assert len(tl.spans) == MAX_SPANS and len(tl.steps) == MAX_STEPS
    growth = _growth(tl, 2000)
    assert growth < 64 << 10, f"{growth} bytes for 2000 steps past the caps"
    assert tl.synced_steps == steps + 2000
    assert tl.dropped_steps == steps + 2000 - MAX_STEPS
    assert tl.dropped_spans == (steps + 2000) * per_step_spans - MAX_SPANS
    timeline._finish(tl)  # what the exit hook does: the rank file, the merge, the line
    data = json.loads(tl.rank_file().read_text())
    assert data["truncated"] is True
    assert (data["dropped_spans"], data["dropped_steps"]) == (tl.dropped_spans, tl.dropped_steps)
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert merged["phalanx"]["dropped"]["0"] == {
        "spans": tl.dropped_spans,
        "steps": tl.dropped_steps,
    }
    said = capsys.readouterr().err
    assert f"kept the first {MAX_SPANS} spans and {MAX_STEPS} steps" in said
    assert f"{tl.dropped_steps} steps after them were counted, not kept" in said


def test_bench_stops_by_the_steps_run_not_the_steps_kept(tmp_path: Path) -> None:
    tl = Timeline(tmp_path / "trace.json", 0, 1, stop_after=MAX_STEPS + 3)
    with pytest.raises(BenchStop) as stopped:
        while True:
            _step(tl, buckets=0)
    assert stopped.value.steps == MAX_STEPS + 3 and len(tl.steps) == MAX_STEPS
