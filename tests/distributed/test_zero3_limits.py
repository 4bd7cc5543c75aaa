"""What stage 3 refuses: each a one-line error on every rank, never a silent wrong answer.

A module sharded twice; a parameter tied between two units; a unit's parameter
used outside its forward (there it is this rank's shard); a fully_shard
argument or policy phalanx does not implement; a placement other than dim 0;
a scalar parameter (FSDP2 refuses it too); an FSDPModule method phalanx does
not implement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import phalanx
from tests.distributed.models import mse_loss, regression_batch
from tests.distributed.test_zero3 import TinyGPT
from tests.harness import Outcome, run_scenarios, run_workers


class ReachesIntoBlock(nn.Module):
    """The head reuses a sharded block's weight by reference: outside that block's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.block(x))
        return self.head(h) + F.linear(h, self.block.weight).sum(-1, keepdim=True)


def _error(action: Callable[[], object]) -> str:
    try:
        action()
    except (phalanx.PhalanxError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _used_outside_forward(rank: int) -> str:
    model = ReachesIntoBlock()
    phalanx.fully_shard(model.block)
    phalanx.fully_shard(model)
    x, y = regression_batch(rank, 0, 0)
    return _error(lambda: mse_loss(model(x), y).backward())


def _wrapped_twice(rank: int) -> str:
    block = nn.Linear(4, 4)
    phalanx.fully_shard(block)
    return _error(lambda: phalanx.fully_shard(block))


def _tied_across_units(rank: int) -> str:
    model = TinyGPT()
    first, second = model.get_submodule("blocks.0.fc"), model.get_submodule("blocks.1.fc")
    first.weight = nn.Parameter(torch.randn(32, 16))
    second.weight = first.weight  # tied between two blocks
    phalanx.fully_shard(model.blocks[0])
    return _error(lambda: phalanx.fully_shard(model.blocks[1]))


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.fc = nn.Linear(4, 4)


class StrangePolicy:
    """Neither OffloadPolicy nor CPUOffloadPolicy."""

    pin_memory = True


def _placement(rank: int) -> str:
    from torch.distributed.tensor import Shard

    return _error(
        lambda: phalanx.fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1))
    )


class Fails(nn.Module):
    """Raises in its forward when told to, after the first block has been gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.blocks[0](x))
        if self.fail:
            raise ValueError("a bad batch")
        return self.blocks[1](x)


def _recovers(rank: int) -> str:
    """After a forward raised mid-way, reset_iter_state() and the next step is a clean one."""
    losses = []
    for fail_first in (False, True):
        torch.manual_seed(3)
        model = Fails()
        for block in model.blocks:
            phalanx.fully_shard(block)
        phalanx.fully_shard(model)
        x, y = regression_batch(rank, 0, 0)
        if fail_first:
            model.fail = True
            try:
                model(x)
            except ValueError:
                model.reset_iter_state()  # type: ignore[operator]
            model.fail = False
        loss = mse_loss(model(x)[:, :4], y)
        loss.backward()
        losses.append(loss.item())
    return "same" if losses[0] == losses[1] else f"differ: {losses}"


SCENARIOS: dict[str, Callable[[int], str]] = {
    "used_outside_forward": _used_outside_forward,
    "wrapped_twice": _wrapped_twice,
    "tied_across_units": _tied_across_units,
    "unknown_argument": lambda r: _error(lambda: phalanx.fully_shard(nn.Linear(4, 4), foo=1)),
    "offload_policy": lambda r: _error(
        lambda: phalanx.fully_shard(nn.Linear(4, 4), offload_policy=StrangePolicy())
    ),
    "mp_policy": lambda r: _error(lambda: phalanx.fully_shard(nn.Linear(4, 4), mp_policy=1)),
    "placement": _placement,
    "reshard_size": lambda r: _error(
        lambda: phalanx.fully_shard(nn.Linear(4, 4), reshard_after_forward=3)
    ),
    "scalar": lambda r: _error(lambda: phalanx.fully_shard(Scalar())),
    "recovers": _recovers,
    "method": lambda r: _error(
        lambda: phalanx.fully_shard(nn.Linear(4, 4)).set_custom_all_gather(None)  # type: ignore[operator]
    ),
}


def _limits(rank: int, world_size: int) -> dict[str, Any]:
    return run_scenarios({k: functools.partial(f, rank) for k, f in SCENARIOS.items()}, rank)


@pytest.fixture(scope="module")
def limits() -> list[Outcome]:
    return run_workers(_limits, 2, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("used_outside_forward", "block.weight"),
        ("wrapped_twice", "already a fully_shard unit"),
        ("tied_across_units", "tied weights"),
        ("unknown_argument", "fully_shard(foo=...) is not supported"),
        ("offload_policy", "is not an OffloadPolicy"),
        ("mp_policy", "is not a MixedPrecisionPolicy"),
        ("placement", "phalanx shards every parameter on dim 0"),
        ("reshard_size", "does not divide the 2 ranks"),
        ("scalar", "'scale' is a scalar"),
        ("method", "set_custom_all_gather is not supported"),
        ("recovers", "same"),
    ],
)
def test_refusals_are_one_clear_error_on_every_rank(
    limits: list[Outcome], case: str, fragment: str
) -> None:
    for o in limits:
        message = o.value[case]
        assert fragment in message, f"rank {o.rank}: {message}"
        assert "\n" not in message, f"rank {o.rank}: not one line: {message}"
