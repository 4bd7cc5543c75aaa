"""2 ranks with batch B each train exactly like 1 process with the batch 2B.

This is the promise of data parallelism itself, checked without torch DDP in
the loop: the single-process reference is a plain module trained on the
concatenation of both ranks' batches (mean-reduced losses, so the averages
match), computed inside each rank. One spawn serves all scenarios.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.distributed.models import (
    MLP,
    BranchNet,
    DeepMLP,
    Recipe,
    ddp_under_test,
    flat,
    mse_loss,
    regression_batch,
    spread_from_rank0,
    train,
)
from tests.harness import Outcome, run_scenarios, run_workers

STEPS = 5
SCENARIOS: dict[str, Recipe] = {
    "mlp": Recipe(MLP, regression_batch, mse_loss),
    "tiny_buckets": Recipe(DeepMLP, regression_batch, mse_loss, {"bucket_cap_mb": 0.01}),
    # 2 micro-batches per rank, the first under no_sync: 4 chunks of B in all.
    "no_sync_2_micro": Recipe(MLP, regression_batch, mse_loss, micro_batches=2),
    "unused_branch": Recipe(
        BranchNet, regression_batch, mse_loss, {"find_unused_parameters": True}
    ),
}


def _concatenated(recipe: Recipe, world_size: int) -> Recipe:
    """The same recipe fed, at every (step, micro), all ranks' batches at once."""

    def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [recipe.batch(r, step, micro) for r in range(world_size)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    return replace(recipe, batch=batch)


def _equivalence(recipe: Recipe, rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # ranks start apart; the wrap must take rank 0's values
    ddp = ddp_under_test()(recipe.build(), **recipe.ddp_kwargs)
    train(ddp, recipe, rank, "sgd", STEPS)
    final = flat(ddp.module.parameters())

    torch.manual_seed(0)  # rank 0's start
    single = recipe.build()
    start = flat(single.parameters())
    train(single, _concatenated(recipe, world_size), rank, "sgd", STEPS)
    torch.manual_seed(0)
    local_only = recipe.build()
    train(local_only, recipe, rank, "sgd", STEPS)
    reference = flat(single.parameters())
    return {
        "diff": float((final - reference).abs().max()),
        "moved": float((reference - start).abs().max()),
        "local_only_diff": float((flat(local_only.parameters()) - reference).abs().max()),
        "spread": spread_from_rank0(final),
    }


def _all_scenarios(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return run_scenarios(
        {
            name: functools.partial(_equivalence, recipe, rank, world_size)
            for name, recipe in SCENARIOS.items()
        },
        rank,
    )


@pytest.fixture(scope="module")
def equivalence_run() -> list[Outcome]:
    return run_workers(_all_scenarios, 2, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_process_with_double_batch(
    equivalence_run: list[Outcome], name: str
) -> None:
    for o in equivalence_run:
        r = o.value[name]
        assert "error" not in r, f"rank {o.rank} raised:\n{r.get('error')}"
        assert r["diff"] <= 1e-6, (
            f"rank {o.rank}: DDP params differ from the single-process 2B run by {r['diff']:.3g}"
        )
        # Sanity: the comparison can fail. Training moved the parameters, and
        # training on this rank's batch alone lands somewhere else.
        assert r["moved"] > 1e-4
        assert r["local_only_diff"] > 1e-4
        assert r["spread"] == 0.0, f"replicas differ across ranks by {r['spread']:.3g}"
