"""zero_stage="auto" for real.

Under a cap: each rank in a memory cgroup whose limit stage 0 does not fit, the Trainer
reads the limit as its budget, plans, and trains to the loss of the run without a
limit. Needs root and a writable memory cgroup (skipped otherwise); the full grid of
budgets, with stage 0 killed under the same caps, is benchmarks/plan_grid.py
(docs/planner.md).

From the seed: a planned run trains bit for bit what the configuration it chose trains
when set by hand. The planner's probe draws random tensors, and a model built on the
meta device takes its weights from torch's generator once the plan is made: before the
planner kept the generator's state, a planned run started from other weights
(benchmarks/plan_grid.py: a loss sum of 3.99978 against 3.99942 for every configuration
it ran, each of them bit-identical to the others).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from phalanx.train import Trainer, TrainingArguments
from tests.checkpoints import record_losses
from tests.harness import run_workers

CAP_MB = 470
"""Over stage 3's predicted peak here (about 410 MB: 310 of libraries, 80 of shards, gradients
and state, 16 of gathered units), under stage 0's (over 500)."""
_V2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
_BASE = Path("/sys/fs/cgroup") if _V2 else Path("/sys/fs/cgroup/memory")


def _groups(tag: str) -> list[Path] | None:
    """One capped cgroup per rank, or None where this process may not make them."""
    if os.geteuid() != 0:
        return None
    groups = []
    try:
        for rank in range(2):
            group = _BASE / f"phalanx-test-plan-{tag}-r{rank}"
            group.mkdir(exist_ok=True)
            limit = "memory.max" if _V2 else "memory.limit_in_bytes"
            (group / limit).write_text(str(CAP_MB * 2**20))
            groups.append(group)
    except OSError:
        return None
    return groups


class _Net(nn.Module):
    """Ten 1000x1000 Linears: 40 MB of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(1000, 1000) for _ in range(10)))

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.body(batch[0])
        return out


def _train(
    rank: int,
    world: int,
    out: str,
    stage: Any,
    groups: list[str] | None = None,
    budget_mb: float | None = None,
) -> dict[str, Any]:
    """Three logged steps at `stage` (an int, or "auto" within the rank's cgroup in `groups`
    or `budget_mb`): the losses, the stage trained, the plan's budget and whether stage 0
    fitted it (None unplanned)."""
    if groups is not None:  # every byte from here on counts against the cap
        (Path(groups[rank]) / "cgroup.procs").write_text(str(os.getpid()))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _Net()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 1000, generator=g), torch.randn(64, 1000, generator=g)
    )
    args = TrainingArguments(
        output_dir=str(Path(out) / f"{stage}-{'capped' if groups else budget_mb}"),
        zero_stage=stage,
        memory_budget_mb=budget_mb,
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        loss_fn=lambda o, b: nn.functional.mse_loss(o, b[1]),
    )
    losses = record_losses(trainer)
    trainer.train()
    plan = trainer.plan
    result = {
        "losses": losses,
        "stage": trainer.args.zero_stage,
        "budget": None if plan is None else plan.budget,
        "stage0_fits": None
        if plan is None
        else any(c.fits for c in plan.candidates if c.config.stage == 0),
    }
    trainer.close()
    return result


@pytest.mark.timeout(240)
def test_auto_under_a_cap_that_stage_0_does_not_fit_trains_to_the_same_loss(tmp_path: Path) -> None:
    groups = _groups(str(os.getpid()))
    if groups is None:
        pytest.skip("needs root and a writable memory cgroup")
    try:
        capped = run_workers(
            _train, 2, str(tmp_path), "auto", [str(g) for g in groups], init_pg=False, timeout=200
        )
    finally:
        for group in groups:
            with contextlib.suppress(OSError):
                group.rmdir()
    free = run_workers(_train, 2, str(tmp_path), 0, init_pg=False, timeout=200)
    for c, f in zip(capped, free):
        assert c.value["budget"] == CAP_MB * 2**20  # the cgroup's limit, read as the budget
        assert c.value["stage0_fits"] is False and c.value["stage"] != 0, c.value
        assert f.value["stage"] == 0
        assert len(c.value["losses"]) == 3
        for a, b in zip(c.value["losses"], f.value["losses"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (c.value["losses"], f.value["losses"])


@pytest.mark.timeout(240)
def test_auto_trains_bit_identically_to_the_stage_it_chose(tmp_path: Path) -> None:
    roomy = 64 * 1024  # MB: every stage fits
    planned = run_workers(_train, 2, str(tmp_path), "auto", None, roomy, init_pg=False, timeout=200)
    stage = planned[0].value["stage"]
    assert planned[0].value["budget"] is not None and isinstance(stage, int), planned[0].value
    by_hand = run_workers(_train, 2, str(tmp_path), stage, init_pg=False, timeout=200)
    for p, h in zip(planned, by_hand):
        assert len(p.value["losses"]) == 3
        assert all(loss > 0.1 for loss in h.value["losses"]), h.value  # a real loss, logged
        assert p.value["losses"] == h.value["losses"]  # bit for bit, not within a tolerance
