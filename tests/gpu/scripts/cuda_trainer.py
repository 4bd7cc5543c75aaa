"""A Trainer job on the GPU: dropout (CUDA RNG), fp16 or bf16, checkpoints, resume.

Usage: cuda_trainer.py OUTPUT_DIR RESULT_FILE --precision {fp16,bf16,fp32}
                       [--max-steps N] [--save-steps N] [--resume]
Writes the final parameters (as lists) and the losses to RESULT_FILE.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.train import Trainer, TrainingArguments


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("result")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=gen)
    data = TensorDataset(x, (x[:, :3].sum(1) * 2).long().clamp(-1, 1) + 1)
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        save_steps=opts.save_steps,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        lr_scheduler_type="constant",  # the same schedule for 12 steps straight and 6 + 6
        fp16=opts.precision == "fp16",
        bf16=opts.precision == "bf16",
        report_to=[],
        disable_tqdm=True,
        seed=3,
    )
    torch.manual_seed(3)
    trainer = Trainer(
        model=DropoutMLP(),
        args=args,
        train_dataset=data,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out.float(), batch[1]),
    )
    out = trainer.train(resume_from_checkpoint=True if opts.resume else None)
    params = [p.detach().float().cpu().reshape(-1).tolist() for p in trainer.model.parameters()]
    device = str(next(trainer.model.parameters()).device)
    with open(opts.result, "w") as f:
        json.dump({"params": params, "device": device, "loss": out.train_loss}, f)
    trainer.close()


if __name__ == "__main__":
    main()
