"""The Trainer's checkpoints on a CUDA device: NCCL, DCP shards of CUDA tensors, CUDA RNG.

Skipped without CUDA. One process, so one GPU is enough: a ZeRO run (stage 1
and 2, a world of one over NCCL) with dropout crashes after step 4, resumes
from checkpoint-3, and must end with the very parameters of the run that was
never interrupted — which needs the CUDA generator states saved per rank and
the optimizer shards written and read back through torch.distributed.checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.train import Trainer, TrainingArguments
from phalanx.train.config.args import ZeroStage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


class _Crash(Exception):
    pass


def _trainer(out: Path, stage: ZeroStage, crash_at: int = 0) -> Trainer:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=gen)
    data = TensorDataset(x, torch.randint(0, 3, (96,), generator=gen))
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        zero_stage=stage,
        ddp_backend="nccl",
        report_to=[],
        disable_tqdm=True,
    )
    box: list[Trainer] = []

    def loss(outputs: Tensor, batch: Any) -> Tensor:
        if crash_at and box[0].state.global_step == crash_at:
            raise _Crash
        return nn.functional.cross_entropy(outputs, batch[1])

    box.append(Trainer(model=_Net(), args=args, train_dataset=data, loss_fn=loss))
    return box[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_run_on_cuda_resumes_bit_identical(tmp_path: Path, stage: ZeroStage) -> None:
    whole = _trainer(tmp_path / "whole", stage)
    whole.train()
    assert whole.world.device.type == "cuda" and whole.world.backend == "nccl"
    with pytest.raises(_Crash):
        _trainer(tmp_path / "split", stage, crash_at=4).train()
    resumed = _trainer(tmp_path / "split", stage)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.resumed_from == str(tmp_path / "split" / "checkpoint-3")
    assert (tmp_path / "split" / "checkpoint-6" / "optimizer" / ".metadata").is_file()
    for ours, theirs in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
