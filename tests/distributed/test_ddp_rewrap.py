"""Wrapping a model a second time detaches the first wrapper instead of reducing twice."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from tests.harness import run_workers


def _wrap_twice_then_train(rank: int, world_size: int) -> dict[str, object]:
    import phalanx

    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    first = phalanx.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    first(torch.randn(3, 4, generator=g)).square().mean().backward()  # first is used once
    second = phalanx.DistributedDataParallel(net)
    for _ in range(3):
        opt.zero_grad()
        second(torch.randn(3, 4, generator=g)).square().mean().backward()
        opt.step()
    saved = io.BytesIO()
    torch.save(net, saved)  # the bookkeeping must not make the model unpicklable
    return {
        "first_rounds": first.reducer.stats.sync_rounds,
        "second_rounds": second.reducer.stats.sync_rounds,
        "params": torch.cat([p.detach().flatten() for p in net.parameters()]).tolist(),
    }


@pytest.mark.timeout(60)
def test_second_wrap_detaches_the_first() -> None:
    r0, r1 = (o.value for o in run_workers(_wrap_twice_then_train, 2))
    # A stale first reducer would still be hooked: the second wrapper's backward would
    # reach it too, and it would fail ("marked ready twice") or reduce again.
    assert r0["first_rounds"] == r1["first_rounds"] == 1
    assert r0["second_rounds"] == r1["second_rounds"] == 3
    assert r0["params"] == r1["params"]


def _who_hooks(rank: int, world_size: int) -> dict[str, bool]:
    import copy

    import phalanx
    from phalanx.ddp.registry import reducer_of, views_of

    net = nn.Linear(4, 2)
    ddp = phalanx.DistributedDataParallel(net)
    found = {
        "wrapped": all(reducer_of(p) is ddp.reducer for p in net.parameters()),
        "one_view": len(views_of(ddp.parameters())) == 1,
        "copy": all(reducer_of(p) is None for p in copy.deepcopy(net).parameters()),
    }
    saved = io.BytesIO()
    torch.save(list(net.parameters()), saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    found["loaded"] = all(reducer_of(p) is None for p in loaded)
    ddp._remove_autograd_hooks()
    found["unhooked"] = all(reducer_of(p) is None for p in net.parameters())
    return found


@pytest.mark.timeout(60)
def test_the_reducer_is_found_from_its_hooks_only() -> None:
    """A parameter names its reducer while hooked; a copy, a pickle and an unhooked one don't."""
    for outcome in run_workers(_who_hooks, 2):
        assert outcome.value == dict.fromkeys(
            ["wrapped", "one_view", "copy", "loaded", "unhooked"], True
        )
