"""A step's gradient is the mean over every sample of the step, whatever the batch sizes
(issue 12, item 10).

Before: each micro-batch's mean loss counted alike, so micro-batches of 8 and 2
(the last, short step of an epoch) gave the 2 samples four times the weight of
the 8 (the gradient 19% off), and ranks with different batch sizes did the
same across ranks. Reference: one process, plain SGD on the concatenated
batch of the step's samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset, default_collate

from phalanx.train import Trainer, TrainingArguments
from tests.harness import run_workers

pytestmark = pytest.mark.faults

STEPS = 3  # one step per epoch: every step sees every sample
LR = 0.5


def _data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(samples, 6, generator=gen)
    y = torch.randint(0, 3, (samples,), generator=gen)
    keep = torch.ones(samples, dtype=torch.long)
    keep[::3] = 0  # a third of the samples are dropped by the collate function
    return TensorDataset(x, y, keep)


def _keep_marked(samples: list[Any]) -> list[Tensor]:
    """Batches of different sizes on each rank, as a filtering collate makes them."""
    return default_collate([s for s in samples if int(s[2])])


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, 3)

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _train(rank: int, world: int, out_dir: str, samples: int, filtering: bool) -> list[Any]:
    """Micro-batches of 8 and 2 (10 samples per rank and epoch, accumulation 2)."""
    model = _Linear()
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_steps=0,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_data(samples),
        loss_fn=_xent,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        collate_fn=_keep_marked if filtering else None,
    )
    trainer.train()
    trainer.close()
    return [p.detach().tolist() for p in model.parameters()]


def _whole_batch(samples: int, filtering: bool) -> list[Tensor]:
    """STEPS steps of plain SGD on the concatenated batch of all (kept) samples."""
    x, y, keep = _data(samples).tensors
    if filtering:
        x, y = x[keep == 1], y[keep == 1]
    model = _Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        nn.functional.cross_entropy(model.net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def _gap(ours: list[Any], reference: list[Tensor]) -> float:
    return max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(ours, reference))


@pytest.mark.timeout(60)
def test_micro_batches_of_8_and_2_weigh_each_sample_alike(tmp_path: Path) -> None:
    ours = _train(0, 1, str(tmp_path), 10, filtering=False)
    assert _gap(ours, _whole_batch(10, filtering=False)) <= 1e-6


@pytest.mark.timeout(120)
def test_ranks_with_different_batch_sizes_weigh_each_sample_alike(tmp_path: Path) -> None:
    # 20 samples on 2 ranks: micro-batches of 8 and 2 before the collate drops a third,
    # unevenly, so the ranks' micro-batches differ in size too.
    runs = run_workers(_train, 2, str(tmp_path), 20, True, init_pg=False, timeout=100)
    reference = _whole_batch(20, filtering=True)
    for run in runs:
        assert _gap(run.value, reference) <= 1e-6
