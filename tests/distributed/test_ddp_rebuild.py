"""The one-time bucket rebuild: real gradient order, rank 0's order on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_workers


class TwoBranches(nn.Module):
    """`a(x) + b(x)`: which branch's gradients arrive first depends on the order of the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if a_first else self.b(x) + self.a(x)


def _train_and_report(rank: int, world_size: int) -> dict[str, object]:
    import phalanx

    torch.manual_seed(0)
    # A cap of a few bytes puts every parameter in a bucket of its own.
    model = phalanx.DistributedDataParallel(TwoBranches(), bucket_cap_mb=1e-5)
    before = model.reducer.bucket_order()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        # Rank 0 sums b first (so a's gradients arrive first), rank 1 the other way round.
        model(torch.randn(4, 8, generator=g), a_first=(rank == 1)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "before": before,
        "after": model.reducer.bucket_order(),
        "rebuilds": model.reducer.stats.rebuilds,
        "rounds": model.reducer.stats.sync_rounds,
        "params": flat.tolist(),  # plain floats: a tensor would travel by a shared fd
    }


@pytest.mark.timeout(90)
def test_buckets_follow_rank0_arrival_order_on_every_rank() -> None:
    r0, r1 = (o.value for o in run_workers(_train_and_report, 2))
    # Before: reverse registration order, b's parameters first.
    assert r0["before"][0][0].startswith("b."), r0["before"]
    # Rank 0 computed b(x) + a(x): autograd runs the later node (a) first, so a's
    # gradients arrived first there; rank 1 saw b's first. Both adopt rank 0's order.
    assert r0["after"] == r1["after"], (r0["after"], r1["after"])
    assert r0["after"] != r0["before"], "the buckets were never rebuilt"
    assert r0["after"][0][0].startswith("a."), r0["after"]
    assert len(r0["after"]) == 4, r0["after"]
    assert r0["rebuilds"] == r1["rebuilds"] == 1
    assert r0["rounds"] == r1["rounds"] == 4
    assert r0["params"] == r1["params"]
