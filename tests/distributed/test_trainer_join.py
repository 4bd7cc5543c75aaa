"""The Trainer's even_batches=False on 3 real ranks, and its communication counters.

61 samples on 3 ranks without padding are 21, 20 and 20 samples: 5, 4 and 4
batches of 5. Ranks 1 and 2 run out first and take part in rank 0's last
step(s) with no batch of their own (phalanx.Join): nobody hangs, every rank
counts the same optimizer steps, and parameters and AdamW state stay
identical on every rank. With gradient accumulation 3 the short ranks run
out inside a step, so their accumulated gradients still go into it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx import DistributedDataParallel
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.callbacks import TrainerCallback
from tests.harness import run_workers


class _OnFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


class _TrainingLogs(TrainerCallback):
    """Every training log line this rank's Trainer hands its callbacks."""

    def __init__(self) -> None:
        self.lines: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if "comm_bytes_per_step" in kw["logs"]:  # not an evaluation's line
            self.lines.append(dict(kw["logs"]))


def _train(rank: int, world: int, out_dir: str, even: bool, accumulation: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _OnFirst()
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(61, 6, generator=gen), torch.randint(0, 3, (61,)))
    args = TrainingArguments(
        output_dir=out_dir,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        save_steps=0,
        num_train_epochs=2,
        per_device_train_batch_size=5,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        even_batches=even,
    )
    logs = _TrainingLogs()
    trainer = Trainer(model=model, args=args, train_dataset=data, loss_fn=_xent, callbacks=[logs])
    logged = logs.lines
    out = trainer.train()
    state = [p.detach().reshape(-1) for p in trainer.model.parameters()]
    for p in trainer.model.parameters():
        state.append(trainer.optimizer.state[p]["exp_avg_sq"].reshape(-1))
    flat = torch.cat(state).double()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert isinstance(trainer.wrapped_model, DistributedDataParallel)
    stats = trainer.wrapped_model.reducer.stats
    return {
        "global_step": out.global_step,
        "spread": max((g - gathered[0]).abs().max().item() for g in gathered),
        "shadow_rounds": stats.shadow_rounds,
        "bytes_per_step": [m["comm_bytes_per_step"] for m in logged],
        "collectives_per_step": [m["collectives_per_step"] for m in logged],
        "grad_bytes": sum(p.numel() * 4 for p in trainer.model.parameters()),
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("accumulation", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_uneven_batches_finish_in_step_with_identical_replicas(
    tmp_path: Path, accumulation: int
) -> None:
    outs = run_workers(_train, 3, str(tmp_path), False, accumulation, init_pg=False, timeout=120)
    steps_per_epoch = -(-5 // accumulation)  # the longest rank's 5 batches
    for o in outs:
        got = o.value
        assert got["global_step"] == 2 * steps_per_epoch, got
        assert got["spread"] == 0.0, got
        assert got["shadow_rounds"] == (0 if o.rank == 0 else 2), got


@pytest.mark.timeout(150)
def test_trainer_logs_bytes_and_collectives_per_step(tmp_path: Path) -> None:
    outs = run_workers(_train, 3, str(tmp_path), True, 1, init_pg=False, timeout=120)
    for o in outs:
        got = o.value
        assert got["shadow_rounds"] == 0, got  # padded: nobody runs out
        # The first step also broadcasts the parameter order of the rebuild; after it, one
        # bucket and the small step signals per step: gradients plus a few bytes.
        assert len(got["bytes_per_step"]) > 1, got  # logging_steps=1: a line a step
        for sent in got["bytes_per_step"][1:]:
            assert got["grad_bytes"] <= sent < got["grad_bytes"] + 256, got
        assert all(calls >= 1 for calls in got["collectives_per_step"]), got
