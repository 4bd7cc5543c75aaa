"""The harness itself: real ranks, a real all-reduce, and a deadlock that fails fast."""

from __future__ import annotations

import time

import pytest

from tests.harness import WorkersFailed, run_workers


def _allreduce_rank(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _rank1_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)


def test_allreduce_sums_ranks() -> None:
    outs = run_workers(_allreduce_rank, 3)
    assert [o.value for o in outs] == [3.0, 3.0, 3.0]


@pytest.mark.slow
def test_hang_fails_within_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(WorkersFailed, match="timed out"):
        run_workers(_rank1_hangs, 2, timeout=8)
    assert time.monotonic() - start < 30
