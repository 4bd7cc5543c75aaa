"""The digits MLP trained by phalanx's Trainer under Ray Train, with no Ray in the function.

    pip install "phalanx[ray,examples]"
    python examples/ray_digits.py            # a local Ray instance, two CPU workers

`train_fn` is a plain Trainer function: under `ray.train.torch.TorchTrainer` the
Trainer finds Ray Train by itself, reports each checkpoint it seals with its loss
(`result.checkpoint`, `result.metrics`), and a restart under `FailureConfig`
resumes Ray's last checkpoint (docs/ray.md). Needs scikit-learn and ray.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import phalanx


class DigitClassifier(nn.Module):
    """8x8 images in, ten scores out; fed the (images, labels) batch the Trainer hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.body(batch[0])


def loss_fn(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def train_fn(config: dict[str, Any]) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    args = phalanx.TrainingArguments(
        output_dir=config["output_dir"],  # storage every worker sees, for sharded checkpoints
        num_train_epochs=2,
        per_device_train_batch_size=32,
        learning_rate=1e-3,
        save_steps=20,
        logging_steps=20,
    )
    trainer = phalanx.Trainer(
        model=DigitClassifier(),
        args=args,
        loss_fn=loss_fn,
        train_dataset=TensorDataset(images, labels),
    )
    trainer.train()


def main() -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from phalanx.integrations.ray import model_state_dict

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        base = tempfile.mkdtemp(prefix="phalanx-ray-")
        trainer = TorchTrainer(
            train_fn,
            train_loop_config={"output_dir": f"{base}/out"},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=f"{base}/ray", failure_config=FailureConfig(max_failures=1)
            ),
        )
        result = trainer.fit()
        print(f"last checkpoint: {result.checkpoint.path}")
        print(f"loss {result.metrics['loss']:.4f} at step {result.metrics['step']}")
        weights = model_state_dict(result.checkpoint)
        print(f"the model's tensors: {sorted(weights)}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
