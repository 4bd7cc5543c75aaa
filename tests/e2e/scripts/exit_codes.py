"""How a phalanx process ends, one way per mode, for tests/e2e/test_exit_codes.py.

Usage: exit_codes.py MODE [OUTPUT_DIR]
- config: phalanx.init(backend="nccl") on a machine without a GPU (a ConfigurationError);
- peer: two ranks all-reduce; rank 1 SIGKILLs itself at the third, rank 0 is left with
  gloo's "Connection closed by peer";
- config-in-group: a ConfigurationError raised once the group exists (torch's hook,
  installed by init_process_group, then wraps phalanx's);
- preempt: a Trainer in one process sends itself SIGTERM during step 2; it saves and stops.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import phalanx


class SignalAt(phalanx.TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def loss_fn(outputs: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, batch[1])


class Net(nn.Linear):
    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch[0])


def main(mode: str, out: str | None) -> None:
    torch.set_num_threads(1)
    if mode == "config":
        phalanx.init(backend="nccl")
    if mode == "config-in-group":
        phalanx.init(backend="gloo", timeout=30)
        raise phalanx.errors.ConfigurationError("raised with the group up — fix it here")
    if mode == "peer":
        world = phalanx.init(backend="gloo", timeout=30)
        tensor = torch.ones(4)
        for step in range(100):
            if world.rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(tensor)
    if mode == "preempt":
        x = torch.randn(32, 4)
        args = phalanx.TrainingArguments(
            output_dir=str(out), max_steps=8, disable_tqdm=True, per_device_train_batch_size=4
        )
        trainer = phalanx.Trainer(
            model=Net(4, 1),
            args=args,
            loss_fn=loss_fn,
            train_dataset=TensorDataset(x, x.sum(1, keepdim=True)),
            callbacks=[SignalAt()],
        )
        trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
