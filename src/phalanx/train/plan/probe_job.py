"""The probe (probe.py) as a job of its own, every rank at once: what `phalanx plan` runs
under the launcher. A module apart, so that `-m` runs it without runpy warning that the
plan package, which imports probe.py, has it loaded already.

    phalanx launch --nproc-per-node 2 -m phalanx.train.plan.probe_job --out rates.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from phalanx.train.plan.probe import measure_rates


def _tiny_trainer_step(out: Path) -> None:
    """One step of a Trainer over a 16x16 Linear (writing under `out`, the same directory on
    every rank): its modules, threads and buffers loaded."""
    from torch.utils.data import TensorDataset

    from phalanx.train import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_steps=1,
    )
    data = TensorDataset(torch.ones(8, 16), torch.ones(8, 16))
    trainer = Trainer(model=_First(), args=args, train_dataset=data, loss_fn=_mse)
    trainer.train()
    trainer.close()


def _mse(out: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, batch[1])


class _First(torch.nn.Module):
    """A 16x16 Linear over the batch's first tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(16, 16)

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.inner(batch[0])
        return out


def main(argv: list[str] | None = None) -> None:
    """The probe as a job of its own (`phalanx plan` runs it under the launcher)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload-dir", default=None)
    ns = parser.parse_args(argv)
    import phalanx

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    world = phalanx.init(backend="gloo")
    _tiny_trainer_step(Path(ns.out).parent / "probe-trainer")  # as a Trainer's process
    rates = measure_rates(world.process_group, ns.offload_dir)
    if world.rank == 0:
        Path(ns.out).write_text(json.dumps(rates.to_json()))


if __name__ == "__main__":
    main()
