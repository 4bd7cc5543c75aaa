"""phalanx's DDP wrapped again in torch's (what accelerate's `prepare(model)` does to the
model it is given) is refused at the first forward, on every rank, in one line: two
reducers would each all-reduce every gradient."""

from __future__ import annotations

import torch
from torch import nn

import phalanx
from tests.distributed.test_ddp_errors import assert_error_on_every_rank
from tests.harness import run_workers


def _wrapped_twice(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    inner = phalanx.DistributedDataParallel(nn.Linear(4, 2))
    outer = torch.nn.parallel.DistributedDataParallel(inner)
    outer(torch.randn(3, 4)).sum().backward()


def _wrapped_once(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    inner = nn.Linear(4, 2)
    model = phalanx.DistributedDataParallel(inner)
    assert model.module is inner
    model(torch.randn(3, 4)).sum().backward()
    assert inner.weight.grad is not None
    return float(inner.weight.grad.sum())


def test_torch_ddp_around_phalanx_ddp_is_refused_on_every_rank() -> None:
    outcomes = run_workers(_wrapped_twice, 2, allow_errors=True, timeout=60)
    assert_error_on_every_rank(
        outcomes, "wrapped again in torch's DistributedDataParallel", "prepare()"
    )
    assert run_workers(_wrapped_once, 2, timeout=60)[0].value is not None
