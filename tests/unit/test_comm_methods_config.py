"""Settings that cannot work are refused at construction, before any collective."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import phalanx
from phalanx.ddp.comm_hooks import CommStats, PowerSGDState, hook_by_name
from phalanx.errors import ConfigurationError
from phalanx.parallel.traffic import Traffic


def test_powersgd_needs_a_start_after_ddps_rebuild() -> None:
    with pytest.raises(ConfigurationError, match=r"start_powerSGD_iter=1 .* use 2 or more"):
        PowerSGDState(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)


def test_powersgd_rank_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="matrix_approximation_rank=0"):
        PowerSGDState(None, matrix_approximation_rank=0)


def test_powersgd_state_refuses_another_rank() -> None:
    saved = PowerSGDState(None, matrix_approximation_rank=2).state_dict()
    with pytest.raises(ConfigurationError, match="saved with matrix_approximation_rank=2"):
        PowerSGDState(None, matrix_approximation_rank=4).load_state_dict(saved)


def test_powersgd_state_round_trips_its_random_generator() -> None:
    state = PowerSGDState(None, random_seed=7)
    state.rng.randint(10)
    copy = PowerSGDState(None)
    copy.load_state_dict(state.state_dict())
    assert copy.rng.randint(1_000_000) == state.rng.randint(1_000_000)


def test_hook_by_name() -> None:
    state, hook = hook_by_name("bf16")
    assert hook is phalanx.comm_hooks.bf16_compress_hook and state.stats.steps == 0
    state, hook = hook_by_name("powersgd", matrix_approximation_rank=4)
    assert isinstance(state, PowerSGDState) and state.matrix_approximation_rank == 4
    with pytest.raises(ConfigurationError, match="unknown comm hook 'int8'"):
        hook_by_name("int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="PowerSGD options"):
        hook_by_name("fp16", matrix_approximation_rank=4)


def test_torch_spelling_is_exported() -> None:
    hooks = phalanx.comm_hooks
    assert hooks.powerSGD_hook is hooks.powersgd_hook


def test_comm_stats_ratio() -> None:
    stats = CommStats()
    assert math.isnan(stats.compression_ratio()) and math.isnan(stats.bytes_per_step())
    stats.gradient_bytes, stats.steps = 400, 2
    stats.add(Traffic(collectives=1, gradient_bytes=100))
    assert stats.compression_ratio() == 0.25 and stats.bytes_per_step() == 50


@pytest.mark.parametrize("cls", [phalanx.LocalSGD, phalanx.DiLoCo])
@pytest.mark.parametrize("every", [0, 2.5])
def test_sync_every_must_be_a_positive_whole_number(cls: type, every: object) -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(ConfigurationError, match="sync_every="):
        cls(net, torch.optim.SGD(net.parameters(), lr=0.1), every)
