"""`phalanx.check_replicas` is quiet on identical replicas and names a one-element drift.

A DDP that broadcasts buffers before each forward (the default) is checked on
its parameters: its BatchNorm statistics follow each rank's batch until the
next forward, as in torch. Buffers nobody broadcasts are checked too.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import phalanx
from tests.distributed.models import MLP, ConvBN, ce_loss, image_batch
from tests.harness import Outcome, run_scenarios, run_workers


def _trained(rank: int) -> Any:
    torch.manual_seed(rank)  # different starts: the wrap must make them equal
    model = phalanx.DistributedDataParallel(ConvBN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = image_batch(rank, step, 0)
        ce_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _check(model: Any) -> str:
    try:
        phalanx.check_replicas(model)
    except phalanx.PhalanxError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "quiet"


def _identical(rank: int) -> str:
    return _check(_trained(rank))


def _one_element_off(rank: int) -> str:
    model = _trained(rank)
    if rank == 2:
        with torch.no_grad():
            model.module.conv2.weight.view(-1)[7] += 1e-6  # one element, one rank, tiny
    return _check(model)


def _buffer_off(rank: int) -> str:
    net = MLP()
    net.register_buffer("ema", torch.zeros(3))
    model = phalanx.DistributedDataParallel(net, broadcast_buffers=False)
    if rank == 1:
        net.get_buffer("ema")[1] = 0.5  # a rank-local buffer nobody broadcasts
    return _check(model)


CASES = {"identical": _identical, "one_element": _one_element_off, "buffer": _buffer_off}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    return run_scenarios({k: functools.partial(f, rank) for k, f in CASES.items()}, rank)


@pytest.fixture(scope="module")
def replica_run() -> list[Outcome]:
    return run_workers(_all, 3, timeout=90)


@pytest.mark.timeout(120)
def test_identical_replicas_pass_quietly(replica_run: list[Outcome]) -> None:
    assert all(o.value["identical"] == "quiet" for o in replica_run), replica_run


@pytest.mark.timeout(120)
def test_one_element_on_one_rank_is_named_on_every_rank(replica_run: list[Outcome]) -> None:
    for o in replica_run:
        message = o.value["one_element"]
        assert message.startswith("ReplicaDivergenceError"), message
        assert "'conv2.weight'" in message and "[2]" in message and "rank 2" in message, message


@pytest.mark.timeout(120)
def test_a_buffer_that_drifted_is_named(replica_run: list[Outcome]) -> None:
    for o in replica_run:
        assert "'ema'" in o.value["buffer"] and "[1]" in o.value["buffer"], o.value["buffer"]
