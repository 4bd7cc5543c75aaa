"""The probe `phalanx bench` launches: times every size, the same on every rank."""

from __future__ import annotations

import pytest
import torch

from phalanx.ddp.allreduce_probe import time_all_reduce
from tests.harness import run_workers


def _probe(rank: int, world: int) -> list[float]:
    return [time_all_reduce(n, torch.device("cpu")) for n in (4096, 1 << 20)]


@pytest.mark.timeout(60)
def test_probe_agrees_on_one_time_per_size_across_ranks() -> None:
    outs = run_workers(_probe, 2)
    assert outs[0].value == outs[1].value  # the slowest rank's time, agreed
    assert all(ms > 0 for ms in outs[0].value)
