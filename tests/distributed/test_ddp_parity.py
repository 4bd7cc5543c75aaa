"""phalanx DDP against torch DDP: after 5 steps, the same parameters and buffers.

One spawn per world size runs every scenario with SGD (momentum) and Adam;
each test then checks one entry of that cached result. Every rank starts from
different parameters (seed + rank) and sees different data, so a reducer that
skips the wrap-time broadcast or the all-reduce cannot pass.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.distributed.models import (
    MLP,
    BranchNet,
    ConvBN,
    DeepMLP,
    DictNet,
    Recipe,
    TiedLM,
    ce_loss,
    class_batch,
    dict_loss,
    frozen_mlp,
    image_batch,
    mse_loss,
    parity_problems,
    regression_batch,
    run_parity,
    token_batch,
)
from tests.harness import Outcome, run_scenarios, run_workers, world_sizes

UNUSED = {"find_unused_parameters": True}

SCENARIOS: dict[str, Recipe] = {
    "mlp": Recipe(MLP, regression_batch, mse_loss),
    "cnn_batchnorm": Recipe(ConvBN, image_batch, ce_loss),
    "unused_branch_never": Recipe(BranchNet, regression_batch, mse_loss, UNUSED),
    "unused_branch_odd_steps": Recipe(
        BranchNet,
        regression_batch,
        mse_loss,
        UNUSED,
        forward_kwargs=lambda rank, step: {"use_branch": step % 2 == 1},
    ),
    "unused_branch_rank0_only": Recipe(
        BranchNet,
        regression_batch,
        mse_loss,
        UNUSED,
        forward_kwargs=lambda rank, step: {"use_branch": rank == 0},
    ),
    "frozen_layer": Recipe(frozen_mlp, regression_batch, mse_loss),
    "tied_weights": Recipe(TiedLM, token_batch, ce_loss),
    "dict_output": Recipe(DictNet, class_batch, dict_loss),
    "no_sync_4_micro": Recipe(MLP, regression_batch, mse_loss, micro_batches=4),
    "no_sync_4_micro_batchnorm": Recipe(ConvBN, image_batch, ce_loss, micro_batches=4),
    # A bucket closes once it reaches the cap (torch's rule), so 0.01 MB = 10 485 B
    # holds about two DeepMLP layers: 4 buckets, against 1 with the default cap.
    "tiny_buckets": Recipe(
        DeepMLP, regression_batch, mse_loss, {"bucket_cap_mb": 0.01}, min_buckets=4
    ),
    "grad_as_bucket_view": Recipe(
        MLP, regression_batch, mse_loss, {"gradient_as_bucket_view": True}
    ),
    "grad_as_bucket_view_tiny_buckets": Recipe(
        DeepMLP,
        regression_batch,
        mse_loss,
        {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01},
        min_buckets=4,
    ),
}
OPTIMIZERS = ("sgd", "adam")
WORLD_SIZES = (2, 3)


def _all_scenarios(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return run_scenarios(
        {
            f"{opt}-{name}": functools.partial(run_parity, recipe, rank, opt)
            for opt in OPTIMIZERS
            for name, recipe in SCENARIOS.items()
        },
        rank,
    )


@pytest.fixture(scope="module", params=world_sizes(*WORLD_SIZES), ids=lambda w: f"ws{w}")
def parity_run(request: pytest.FixtureRequest) -> list[Outcome]:
    # One spawn (about 3 s of start-up on two cores) serves every test of a world size.
    return run_workers(_all_scenarios, request.param, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_matches_torch_ddp(parity_run: list[Outcome], opt: str, name: str) -> None:
    per_rank = [Outcome(o.rank, o.exitcode, value=o.value[f"{opt}-{name}"]) for o in parity_run]
    problems = parity_problems(per_rank)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
