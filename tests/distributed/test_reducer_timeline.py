"""The reducer's spans in the timeline, on 2 real ranks: backward, each bucket's flight
(launch to its collective's completion, with its bytes), and the end-of-backward wait.
Off (no PHALANX_TIMELINE), the reducer holds no timeline at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.models import DeepMLP, ddp_under_test, mse_loss, regression_batch
from tests.harness import run_workers


def _spans(rank: int, world_size: int) -> dict[str, Any]:
    model = ddp_under_test()(DeepMLP(), bucket_cap_mb=0.01)
    for step in range(3):
        x, y = regression_batch(rank, step, 0)
        mse_loss(model(x), y).backward()
    timeline = model.reducer.timeline
    if timeline is None:
        return {"timeline": None}
    spans = [
        (name, track, start, start + dur, args) for name, track, start, dur, args in timeline.spans
    ]
    return {
        "timeline": True,
        "buckets": len(model.reducer.buckets),
        "grad_bytes": sum(b.grad_bytes for b in model.reducer.buckets),
        "steps": [
            {"backward": s.backward, "exposed": s.exposed_ns, "flights": s.flights}
            for s in timeline.steps
        ],
        "names": sorted({name.split()[0] for name, *_ in spans}),
        "comm_tracks": sorted({track for name, track, *_ in spans if name.startswith("bucket")}),
    }


@pytest.mark.timeout(120)
def test_bucket_flights_lie_in_backward_and_the_wait_is_recorded(tmp_path: Path) -> None:
    env = {"PHALANX_TIMELINE": str(tmp_path / "trace.json")}
    outs = run_workers(_spans, 2, env=env, timeout=90)
    for o in outs:
        got = o.value
        assert got["timeline"], got
        assert got["names"] == ["backward", "bucket", "forward", "wait"], got  # forward: DDP
        assert got["comm_tracks"] == ["comm"], got
        assert len(got["steps"]) == 3, got
        for step in got["steps"][1:]:  # after the rebuild: several buckets per step
            start, end = step["backward"]
            flights = sorted(step["flights"])
            assert len(flights) == got["buckets"] > 1, got
            assert sum(nbytes for *_, nbytes in flights) == got["grad_bytes"], got
            for launch, done, _ in flights[:-1]:  # all but the last launch during backward
                assert start <= launch <= end <= end + step["exposed"], step
                assert done >= launch, step
            assert step["exposed"] > 0, step


@pytest.mark.timeout(120)
def test_no_timeline_when_off() -> None:
    for o in run_workers(_spans, 2, timeout=90):
        assert o.value == {"timeline": None}


def _profiled_finalize(rank: int, world_size: int) -> dict[str, int]:
    from torch.profiler import profile

    model = ddp_under_test()(DeepMLP())
    x, y = regression_batch(rank, 0, 0)
    mse_loss(model(x), y).backward()  # unprofiled: no span, and nothing recorded
    with profile() as prof:
        for step in (1, 2):
            x, y = regression_batch(rank, step, 0)
            mse_loss(model(x), y).backward()
    names = [event.name for event in prof.events()]
    return {
        "finalize": names.count("phalanx.ddp.finalize"),
        "syncs": model.reducer.stats.sync_rounds,
    }


@pytest.mark.timeout(120)
def test_torch_profiler_sees_the_end_of_backward_span() -> None:
    """The reducer's end-of-backward span reaches torch.profiler when one records (it is
    opened only then: a record_function costs ~60 µs a step at that point)."""
    for o in run_workers(_profiled_finalize, 2, timeout=90):
        assert o.value == {"finalize": 2, "syncs": 3}, o.value
