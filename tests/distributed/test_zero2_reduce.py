"""ZeRO-2 finishes each bucket's reduce-scatter once done and reuses its input, with
ZeRO-1's bits.

Two real gloo ranks train the same model twice side by side, ZeRO-1 (a bucketed
all-reduce) and ZeRO-2 (a reduce-scatter per bucket), with buckets small enough that
there are several, two micro-batches (the first under no_sync) and clipping. Their
parameters must be equal bit for bit after every step.

Each ZeRO-2 launch first finishes the reduce-scatters already done and lays its bucket
out in an input one of them gave back (optim/grad_sharding.py, `Staging`). Here each
launch first waits until the ones in flight are done, so which launch reuses is certain:
after the first step's, which sets the largest input aside, no launch needs new memory,
and at most two inputs are kept between steps.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.optim.grad_sharding import ReduceScatter, Staging
from tests.distributed.models import flat, mse_loss, regression_batch
from tests.harness import run_workers

STEPS, MICRO = 6, 2


def _model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 96),
        nn.Tanh(), nn.Linear(96, 4),
    )  # fmt: skip


class _CountingStaging(Staging):
    """Staging that counts what each launch got: a kept input, or new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = self.new = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        got = super().take(numel, dtype, device)
        reused = got._base is not None  # a kept input's first elements; new memory is its own
        self.kept += reused
        self.new += not reused
        return got


def _train_side_by_side(rank: int, world_size: int) -> dict[str, Any]:
    built = {}
    for stage in (1, 2):
        model = phalanx.DistributedDataParallel(_model(), bucket_cap_mb=0.03)
        opt = phalanx.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, shard_gradients=stage == 2, lr=0.01
        )
        built[stage] = (model, opt)
    reduction = built[2][0].reducer.bucket_set.reduction
    assert isinstance(reduction, ReduceScatter)
    staging = reduction._staging = _CountingStaging()
    buckets = len(built[2][0].reducer.bucket_set.buckets)
    launch = reduction.launch

    def launch_once_the_others_are_done(bucket: Any) -> Any:
        for pending in reduction._in_flight:
            pending.state.work.wait()
        return launch(bucket)

    reduction.launch = launch_once_the_others_are_done  # type: ignore[method-assign]
    params: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    kept_after_step, new_per_step = [], []
    for step in range(STEPS):
        new_before = staging.new
        for stage, (model, opt) in built.items():
            for micro in range(MICRO):
                x, y = regression_batch(rank, step, micro)
                with model.no_sync() if micro < MICRO - 1 else nullcontext():
                    (mse_loss(model(x), y) / MICRO).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            params[stage].append(flat(model.module.parameters()))
        kept_after_step.append(len(staging.free))
        new_per_step.append(staging.new - new_before)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(params[1], params[2])],
        "moved": float((params[2][-1] - params[2][0]).abs().max()),
        "buckets": buckets,
        "kept_after_step": kept_after_step,
        "new_per_step": new_per_step,
        "launches": staging.kept + staging.new,
    }


@pytest.mark.timeout(120)
def test_zero2_matches_zero1_bit_for_bit_and_reuses_its_inputs() -> None:
    for o in run_workers(_train_side_by_side, 2, timeout=90):
        got = o.value
        assert got["buckets"] >= 3, f"test bug: too few buckets to stage: {got}"
        assert got["moved"] > 1e-3, f"test bug: training barely moved: {got}"
        assert all(got["equal"]), f"rank {o.rank}: ZeRO-2 left ZeRO-1's numbers: {got}"
        assert got["launches"] == STEPS * got["buckets"], got
        assert all(1 <= kept <= 2 for kept in got["kept_after_step"]), got
        assert got["new_per_step"][0] >= 1, got
        assert got["new_per_step"][1:] == [0] * (STEPS - 1), got
