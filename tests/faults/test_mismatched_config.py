"""Ranks configured differently stop at setup with one line naming the setting, on every rank.

Before, different `zero_stage` or `ddp_bucket_cap_mb` on two ranks ended in a
gloo SIGABRT mid-step (the ranks issued different collectives), and the
launcher blamed rank 0 as "did not arrive". Now the Trainer compares its
arguments, and DistributedDataParallel and fully_shard compare what shapes
their collectives, at the first collective they make. Real gloo ranks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import phalanx
from tests.faults.trainkit import make_trainer
from tests.harness import run_workers

CASES: dict[str, tuple[str, str]] = {
    # case: (the setting the message names, each rank's value as it prints)
    "zero_stage": ("zero_stage", "rank 0: 1, rank 1: 2"),
    "bucket_cap_trainer": ("ddp_bucket_cap_mb", "rank 0: 25.0, rank 1: 5.0"),
    "bucket_cap_ddp": ("bucket_cap_mb", "rank 0: [1.0, 25.0], rank 1: [1.0, 5.0]"),
    "wrapper": (
        "wrapper",
        "'phalanx.DistributedDataParallel', rank 1: 'phalanx.fully_shard(Linear)'",
    ),
    "reshard": ("reshard_after_forward", "rank 0: True, rank 1: False"),
}


def _case(case: str, rank: int, out_dir: str) -> None:
    first = rank == 0
    if case == "zero_stage":
        make_trainer(Path(out_dir), zero_stage=1 if first else 2)
    elif case == "bucket_cap_trainer":
        make_trainer(Path(out_dir), ddp_bucket_cap_mb=25.0 if first else 5.0)
    else:
        phalanx.init(backend="gloo")
        model = nn.Linear(8, 8)
        if case == "bucket_cap_ddp":
            phalanx.DistributedDataParallel(model, bucket_cap_mb=25 if first else 5)
        elif case == "wrapper":
            if first:
                phalanx.DistributedDataParallel(model)
            else:
                phalanx.fully_shard(model)
        else:
            phalanx.fully_shard(model, reshard_after_forward=first)


def _run(rank: int, world: int, case: str, out_dir: str) -> str:
    try:
        _case(case, rank, out_dir)
    except phalanx.ConfigurationError as exc:
        return str(exc)
    return "no error"


def _check(outcomes: list[Any], case: str) -> None:
    setting, values = CASES[case]
    for o in outcomes:
        message = o.value
        assert "ranks are configured differently" in message, f"rank {o.rank}: {message}"
        assert setting in message and values in message, f"rank {o.rank}: {message}"
        assert "\n" not in message


@pytest.mark.faults
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_setting_that_differs_is_named_on_every_rank(tmp_path: Path, case: str) -> None:
    outcomes = run_workers(_run, 2, case, str(tmp_path), init_pg=False, timeout=90)
    _check(outcomes, case)


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_mismatches_soak(tmp_path: Path, case: str) -> None:
    """make test-slow: ten trials of each case, every one named on every rank."""
    for trial in range(10):
        run = functools.partial(run_workers, _run, 2, case, str(tmp_path / str(trial)))
        _check(run(init_pg=False, timeout=90), case)
