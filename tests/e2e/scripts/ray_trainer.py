"""A plain phalanx Trainer function for Ray Train's TorchTrainer: no line of Ray in it.

tests/e2e/test_ray.py runs it on two CPU workers. `config` says the ZeRO stage,
where to write, and whether rank 1 SIGKILLs itself once, mid-run (at step 3, after
checkpoint-2 was reported, on the first attempt only: a marker file says it
happened). Rank 0 records what `train()` returned, per attempt, for the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.train.checkpoint.directory import PREFIX

MAX_STEPS = 6
SAVE_STEPS = 2
KILL_AT = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.body(batch[0])


def loss_fn(outputs: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, batch[1])


class KillOnce(phalanx.TrainerCallback):
    """Rank 1 dies by SIGKILL once, from step KILL_AT of the first attempt on, at the first
    step end where Ray has registered checkpoint-2: its controller collects reports a poll
    after they are made, and a death before that poll loses the report (Ray restores the
    one before). A background save is reported when it is collected, a step or two after it
    began; by the end of step KILL_AT + 2 it has been (the save at step 4 waited for it), so
    the callback waits there for Ray's poll. The marker holds the newest checkpoint Ray had
    registered at the kill: the one the next attempt must resume."""

    def __init__(self, marker: Path, run_dir: Path) -> None:
        self.marker = marker
        self.snapshot = run_dir / "checkpoint_manager_snapshot.json"  # Ray's, per run

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step < KILL_AT or int(os.environ["RANK"]) != 1 or self.marker.exists():
            return
        deadline = time.monotonic() + 60
        while f"{PREFIX}2" not in _read(self.snapshot):
            if step < KILL_AT + 2:
                return  # not reported yet: train on
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray never registered {PREFIX}2 in {self.snapshot}")
            time.sleep(0.05)
        registered = re.findall(rf"{PREFIX}(\d+)", _read(self.snapshot))
        self.marker.write_text(f"{PREFIX}{max(int(n) for n in registered)}")
        os.kill(os.getpid(), signal.SIGKILL)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def train_fn(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=data)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    torch.manual_seed(0)
    args = phalanx.TrainingArguments(
        output_dir=config["out"],
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        save_steps=SAVE_STEPS,
        logging_steps=SAVE_STEPS,
        learning_rate=0.05,
        zero_stage=config["stage"],
        report_to=["console"],
        timeline=config["timeline"],
        disable_tqdm=True,
    )
    kill = KillOnce(Path(config["marker"]), Path(config["ray_run"]))
    callbacks = [kill] if config["kill"] else []
    trainer = phalanx.Trainer(
        model=Net(), args=args, train_dataset=dataset, loss_fn=loss_fn, callbacks=callbacks
    )
    output = trainer.train()
    if trainer.world.is_main:
        record = {
            "launcher": output.launcher,
            "world_launcher": trainer.world.launcher,
            "global_step": output.global_step,
            "train_loss": output.train_loss,
            "resumed_from": output.resumed_from,
            "timeline_written": Path(config["timeline"]).exists(),
        }
        records = Path(config["records"])
        attempt = len(list(records.glob("attempt-*.json")))
        (records / f"attempt-{attempt}.json").write_text(json.dumps(record))
