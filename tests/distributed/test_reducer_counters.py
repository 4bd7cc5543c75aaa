"""The reducer's counters mean what they say, on 2 real ranks.

`comm_wait_s` is the time the end of backward spent waiting for the bucket
collectives: above zero once buckets were waited on, below the time of the
steps it was measured in, and untouched by a no_sync() backward (which
waits for nothing).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.distributed.models import MLP, ddp_under_test, mse_loss, regression_batch
from tests.harness import run_workers


def _counters(rank: int, world_size: int) -> dict[str, Any]:
    model = ddp_under_test()(MLP(hidden=256))
    stats = model.reducer.stats
    steps, wall = 5, 0.0
    for step in range(steps):
        x, y = regression_batch(rank, step, 0)
        start = time.perf_counter()
        mse_loss(model(x), y).backward()
        wall += time.perf_counter() - start
    after_synced = (stats.comm_wait_s, stats.sync_rounds, stats.buckets_launched)
    with model.no_sync():
        for micro in range(3):
            x, y = regression_batch(rank, 99, micro)
            mse_loss(model(x), y).backward()
    after_local = (stats.comm_wait_s, stats.sync_rounds, stats.buckets_launched)
    return {"steps": steps, "wall": wall, "synced": after_synced, "local": after_local}


@pytest.mark.timeout(90)
def test_comm_wait_is_positive_below_step_time_and_untouched_by_no_sync() -> None:
    for o in run_workers(_counters, 2):
        got = o.value
        wait, rounds, launched = got["synced"]
        assert rounds == got["steps"] and launched >= got["steps"], got
        assert 0.0 < wait < got["wall"], f"rank {o.rank}: comm_wait_s={wait}, steps took {got}"
        assert got["local"] == got["synced"], f"rank {o.rank}: no_sync moved the counters: {got}"
