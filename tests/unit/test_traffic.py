"""The one traffic record: it adds up, windows subtract, and a source carried across live
recovery's re-wrap counts the lost wrapper's bytes once and the surviving counters once."""

from __future__ import annotations

import torch

from phalanx.parallel.traffic import NO_TRAFFIC, Collective, ReducerStats, Traffic
from phalanx.train.logging.runlog import continue_from


def test_ring_estimates_per_kind_at_four_ranks() -> None:
    assert Traffic.of(Collective.ALL_REDUCE, 4, gradient_bytes=400).wire_bytes == 600
    for kind in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER, Collective.BROADCAST):
        assert Traffic.of(kind, 4, other_bytes=400).wire_bytes == 300
    gathered = Traffic.of_tensor(Collective.ALL_GATHER, torch.zeros(10), 2, gradients=False)
    assert (gathered.other_bytes, gathered.gradient_bytes, gathered.collectives) == (40, 0, 1)


def test_records_add_and_windows_subtract() -> None:
    a = Traffic(collectives=2, gradient_bytes=100, other_bytes=8, wire_bytes=108.0, wait_s=0.5)
    b = Traffic.waited(0.25) + Traffic.of(Collective.ALL_REDUCE, 2, gradient_bytes=50)
    total = a + b
    assert (total.collectives, total.bytes_sent, total.wait_s) == (3, 158, 0.75)
    assert total - a == b and total - total == NO_TRAFFIC


def test_reducer_counters_read_the_record() -> None:
    stats = ReducerStats()
    stats.add(Traffic.of(Collective.ALL_REDUCE, 2, gradient_bytes=64, other_bytes=8))
    stats.add(Traffic.waited(0.125))
    assert (stats.collectives, stats.gradient_bytes, stats.other_bytes) == (1, 64, 8)
    assert (stats.bytes_sent, stats.wire_bytes, stats.comm_wait_s) == (72, 72.0, 0.125)


def test_a_continued_source_counts_the_lost_wrapper_once() -> None:
    lost_reducer = Traffic(collectives=5, gradient_bytes=500)
    surviving = [Traffic(collectives=1, other_bytes=40)]  # a periodic sync's, say
    new_reducer = [NO_TRAFFIC]
    earlier = lost_reducer + surviving[0]
    source = continue_from(lambda: new_reducer[0] + surviving[0], earlier)
    assert source() == earlier  # nothing counted twice at the re-wrap
    new_reducer[0] = Traffic(collectives=2, gradient_bytes=200)
    surviving[0] += Traffic(collectives=1, other_bytes=40)
    assert source() - earlier == Traffic(collectives=3, gradient_bytes=200, other_bytes=40)
