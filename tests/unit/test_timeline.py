"""The timeline's arithmetic and its Chrome trace, without a process group."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from phalanx.diagnostics.timeline import StepRecord, Timeline, merge


def test_hidden_is_the_part_of_each_flight_inside_backward() -> None:
    record = StepRecord(0, backward=(100, 200))
    record.flights = [(120, 150, 10), (180, 260, 10), (90, 110, 10)]
    assert record.hidden_ns() == 30 + 20 + 10


class _Done:
    """A future already complete: add_done_callback runs at once, as torch's does."""

    def add_done_callback(self, fn: Callable[[_Done], object]) -> None:
        fn(self)


def test_two_ranks_merge_into_one_trace_with_a_comm_track_each(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    for rank in range(2):
        timeline = Timeline(path, rank, 2)
        with timeline.span("forward"):
            pass
        timeline.backward_started()
        timeline.bucket_launched(0, 4096, _Done())
        assert timeline._current is not None
        timeline.backward_waited(
            timeline._current.backward[0] + 5, timeline._current.backward[0] + 9
        )
        timeline.write()
    trace = merge(path, 2, wait_s=1)
    assert json.loads(path.read_text()) == trace
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {
        (0, "rank 0 compute"),
        (0, "rank 0 comm"),
        (1, "rank 1 compute"),
        (1, "rank 1 comm"),
    }
    buckets = [e for e in trace["traceEvents"] if e["name"] == "bucket 0"]
    assert len(buckets) == 2 and all(e["tid"] == 1 and e["args"]["bytes"] == 4096 for e in buckets)
    assert trace["phalanx"]["steps"]["0"][0]["bytes"] == 4096
