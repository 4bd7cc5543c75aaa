"""A resume at another world size reads of the checkpoint what each rank holds, not whole items
(runtime/dcp_ranges.py; issue 39, "Loads that read only what each rank needs").

A stage-3 Trainer saves a model of 512x512 layers with AdamW at one world size
and another resumes it at another: each rank counts the bytes the reader read
(directories and pickles included) against the bytes of the shards it holds
once loaded (parameters and AdamW's moments). torch's reader loads every item a
rank touches whole: from 1 rank to 2 that is twice what each holds, from 2 to 3
up to 1.5 times. Held to 1.1 times; the resumed model equals the saved one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from phalanx.runtime import safe_dcp
from tests.faults.trainkit import make_trainer
from tests.harness import run_workers

STEPS = 2


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))
        self.head = nn.Linear(512, 3)

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.head(self.blocks(nn.functional.pad(batch[0], (0, 506))))


def _held(trainer: Any) -> int:
    """The bytes of this rank's shards: parameters, and the optimizer's tensors."""
    params = sum(getattr(p, "_local_tensor", p).nbytes for p in trainer.model.parameters())
    state = trainer.optimizer.state.values()
    moments = sum(getattr(v, "_local_tensor", v).nbytes for s in state for v in s.values())
    return params + moments


def _save(rank: int, world: int, out: str) -> list[list[float]]:
    trainer = make_trainer(out, model=_Wide(), zero_stage=3, max_steps=STEPS, save_steps=STEPS)
    trainer.train()
    full = [p.full_tensor().reshape(-1).tolist() for p in trainer.model.parameters()]  # type: ignore[attr-defined]
    return full if rank == 0 else []


def _resume(rank: int, world: int, out: str) -> dict[str, Any]:
    read: list[int] = []
    original = safe_dcp.SafeReader.read_data

    def counted(self: safe_dcp.SafeReader, plan: Any, planner: Any) -> Any:
        before = self.bytes_read
        done = original(self, plan, planner)
        read.append(self.bytes_read - before)
        return done

    safe_dcp.SafeReader.read_data = counted  # type: ignore[method-assign]
    trainer = make_trainer(
        Path(out).with_name(f"resumed{world}"), model=_Wide(), zero_stage=3, max_steps=STEPS
    )
    trainer.train(resume_from_checkpoint=str(Path(out) / f"checkpoint-{STEPS}"))
    full = [p.full_tensor().reshape(-1).tolist() for p in trainer.model.parameters()]  # type: ignore[attr-defined]
    return {"read": sum(read), "held": _held(trainer), "full": full if rank == 0 else []}


def _check(tmp_path: Path, saved_at: int, resumed_at: int) -> list[float]:
    out = str(tmp_path / f"saved{saved_at}")
    saved = run_workers(_save, saved_at, out, init_pg=False, timeout=150)[0].value
    runs = run_workers(_resume, resumed_at, out, init_pg=False, timeout=150)
    assert runs[0].value["full"] == saved, "the resumed model is not the saved one"
    ratios = [run.value["read"] / run.value["held"] for run in runs]
    assert all(ratio <= 1.1 for ratio in ratios), ratios
    return ratios


@pytest.mark.timeout(320)
def test_one_rank_to_two_reads_what_each_rank_holds(tmp_path: Path) -> None:
    _check(tmp_path, 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(640)
@pytest.mark.parametrize(("saved_at", "resumed_at"), [(2, 3), (3, 2)])
def test_two_to_three_and_three_to_two_read_what_each_rank_holds(
    tmp_path: Path, saved_at: int, resumed_at: int
) -> None:
    print(
        f"{saved_at} -> {resumed_at}: read / held per rank", _check(tmp_path, saved_at, resumed_at)
    )
