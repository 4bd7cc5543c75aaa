"""bucket_cap_mb="auto" on 2 real ranks: a measurement in the first steps, one choice made
by rank 0 and applied identically everywhere, and the gradients still torch's.

The model (three 1 MiB layers) has two distinct bucket layouts among the
candidate sizes, so the tuner really switches layouts through the rebuild path.
Rank 1's timings are skewed on purpose (it reports each candidate as slower
the smaller it is, the opposite of rank 0's); the ranks must still agree.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.ddp import autotune
from tests.distributed.models import regression_batch
from tests.harness import run_workers

STEPS = 2 + 2 * 2 * (autotune.SETTLE_STEPS + autotune.TIMED_STEPS) + 2


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 512)
        self.a = nn.Linear(512, 512)
        self.b = nn.Linear(512, 512)
        self.c = nn.Linear(512, 512)
        self.out = nn.Linear(512, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(self.inp(x))))))))


def _train(model: Any, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, _ = regression_batch(rank, step, 0)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _auto(rank: int, world_size: int) -> dict[str, Any]:
    import phalanx

    torch.manual_seed(0)
    ref_net = Wide()
    torch.manual_seed(0)
    our_net = Wide()
    _train(torch.nn.parallel.DistributedDataParallel(ref_net), rank)
    ours = phalanx.DistributedDataParallel(our_net, bucket_cap_mb="auto")
    tuner = ours.reducer.plan.tuner
    assert tuner is not None, "bucket_cap_mb='auto' plans with a tuner"
    if rank == 1:  # disagree with rank 0 on purpose: small buckets look slow here
        real = tuner.record

        def skewed(seconds: float) -> None:
            step = tuner._plan[tuner._step][0] if 0 <= tuner._step < len(tuner._plan) else 0
            real(seconds + 10.0 / (1 + step))

        tuner.record = skewed  # type: ignore[method-assign]
    layouts: list[list[list[str]]] = []
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    for step in range(STEPS):
        x, _ = regression_batch(rank, step, 0)
        ours(x).pow(2).mean().backward()
        layouts.append(ours.reducer.bucket_order())
        opt.step()
        opt.zero_grad()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(ref_net.parameters(), our_net.parameters())
    )
    distinct = [layouts[0]] + [b for a, b in itertools.pairwise(layouts) if a != b]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (tuner.chosen_mb, ours.reducer.bucket_order()))
    return {
        "diff": diff,
        "chosen_mb": tuner.chosen_mb,
        "timed": sorted(tuner.timings),
        "layouts_seen": len(distinct),
        "same_everywhere": all(g == gathered[0] for g in gathered),
        "final_layout_steps": sum(1 for lay in layouts if lay == layouts[-1]),
    }


@pytest.mark.timeout(120)
def test_auto_bucket_size_is_measured_chosen_once_and_identical_on_every_rank() -> None:
    outcomes = run_workers(_auto, 2, timeout=90)
    for o in outcomes:
        got = o.value
        assert got["same_everywhere"], got
        assert got["chosen_mb"] in autotune.CANDIDATES_MB, got
        assert got["timed"] == [1.0, 5.0], got  # the two distinct layouts, each timed
        assert got["layouts_seen"] >= 2, got  # the tuner switched layouts for real
        assert got["final_layout_steps"] >= 2, got  # and then kept its choice
        assert got["diff"] <= 1e-6, got
