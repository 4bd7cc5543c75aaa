"""The public entry points document every argument, as FSDP2's fully_shard does: each
parameter's name stands in the docstring a user reads with help()."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import phalanx


def _entry_points() -> list[tuple[str, Callable[..., Any], str]]:
    ddp, zero = phalanx.DistributedDataParallel, phalanx.ZeroRedundancyOptimizer
    return [
        ("DistributedDataParallel", ddp.__init__, ddp.__doc__ or ""),
        ("ZeroRedundancyOptimizer", zero.__init__, zero.__doc__ or ""),
        ("fully_shard", phalanx.fully_shard, phalanx.fully_shard.__doc__ or ""),
        ("Trainer", phalanx.Trainer.__init__, phalanx.Trainer.__doc__ or ""),
        ("materialize", phalanx.materialize, phalanx.materialize.__doc__ or ""),
    ]


@pytest.mark.parametrize(("name", "function", "doc"), _entry_points(), ids=lambda v: str(v)[:24])
def test_every_argument_is_documented(name: str, function: Callable[..., Any], doc: str) -> None:
    params = [
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.name != "self" and p.kind is not p.VAR_KEYWORD
    ]
    missing = [p for p in params if p not in doc]
    assert missing == [], f"{name}'s docstring does not name {missing}"
