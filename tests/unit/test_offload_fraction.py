"""Which tensors a fractional disk offload puts in files (offload/fraction.py), on real
tensors and a real meta-built model: no process group needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.offload import DiskOffloadPolicy
from phalanx.offload.fraction import largest_first, shard_share, state_share


def test_largest_first_reaches_the_share_with_the_largest() -> None:
    sizes = [("a", 10), ("b", 40), ("c", 30), ("d", 20)]
    assert largest_first(sizes, 0.0) == set()
    assert largest_first(sizes, 0.4) == {"b"}
    assert largest_first(sizes, 0.41) == {"b", "c"}  # at least the share: a budget is met
    assert largest_first(sizes, 1.0) == {"a", "b", "c", "d"}


def test_equal_sizes_are_taken_in_the_order_given() -> None:
    sizes = [(i, 8) for i in range(4)]
    assert largest_first(sizes, 0.5) == {0, 1}


def test_coldest_puts_the_state_first_then_the_shards() -> None:
    # Adam: state 2 bytes per parameter byte, shard and gradient 2: half of stage 3's bytes.
    assert [state_share(f, "coldest", True) for f in (0, 0.25, 0.5, 0.75, 1)] == [
        0,
        0.5,
        1,
        1,
        1,
    ]
    assert [shard_share(f, "coldest") for f in (0, 0.25, 0.5, 0.75, 1)] == [0, 0, 0, 0.5, 1]
    assert state_share(0.25, "coldest", False) == 0.25  # stages 1-2: the state is all of it
    assert state_share(0.25, "largest", True) == shard_share(0.25, "largest") == 0.25


def test_a_policy_refuses_a_fraction_outside_0_1(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"fraction=1.5\) must be in \[0, 1\]"):
        DiskOffloadPolicy(path=str(tmp_path), fraction=1.5)
    with pytest.raises(ConfigurationError, match="order='hottest'"):
        DiskOffloadPolicy(path=str(tmp_path), order="hottest")  # type: ignore[arg-type]


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))


def test_the_plan_keeps_the_largest_shards_in_files(tmp_path: Path) -> None:
    """0.75 coldest at stage 3: all of the state and half of the shards' bytes, the
    largest first (the 64x256 weight: 16384 of 24864 elements)."""
    model = _meta_mlp()
    policy = DiskOffloadPolicy(path=str(tmp_path), fraction=0.75)
    policy.plan(model.parameters())
    placed = {name: policy.shard_in_files(p) for name, p in model.named_parameters()}
    assert placed == {"0.weight": True, "0.bias": False, "2.weight": False, "2.bias": False}
    assert policy.state_share(True) == 1.0


def test_an_unplanned_parameter_is_said_so(tmp_path: Path) -> None:
    policy = DiskOffloadPolicy(path=str(tmp_path), fraction=0.75)
    assert policy.shard_in_files(nn.Parameter(torch.zeros(3))) is None
    assert DiskOffloadPolicy(path=str(tmp_path)).shard_in_files(torch.zeros(3)) is True
    no_params = DiskOffloadPolicy(path=str(tmp_path), fraction=0.75, params=False)
    assert no_params.shard_in_files(torch.zeros(3)) is False
