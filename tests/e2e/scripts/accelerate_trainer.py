"""A phalanx Trainer script run by `accelerate launch --multi_gpu`: it must see world 2 and
end with identical replicas (checked every 2 steps and at the end). Writes
OUT/result_<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.body(batch[0])


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = Net()
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    args = phalanx.TrainingArguments(
        output_dir=str(out / "run"), max_steps=6, per_device_train_batch_size=4,
        replica_check_steps=2, save_steps=10_000, report_to=[], disable_tqdm=True,
    )  # fmt: skip
    trainer = phalanx.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        loss_fn=lambda outputs, batch: nn.functional.cross_entropy(outputs, batch[1]),
    )
    result = trainer.train()
    phalanx.check_replicas(trainer.wrapped_model)
    record = {"rank": trainer.world.rank, "world_size": trainer.world.world_size,
              "steps": result.global_step}  # fmt: skip
    (out / f"result_{trainer.world.rank}.json").write_text(json.dumps(record))
    trainer.close()
