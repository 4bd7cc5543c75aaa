"""A Trainer job for the exact-resume test: dropout, shuffled data, epochs crossed.

Usage: trainer_resume.py OUTPUT_DIR RESULT_FILE [--kill-after-step N] [--kill-rank R] [--resume]
                         [--save-steps N] [--max-steps N] [--kill-on-first-attempt-only]
                         [--zero-stage {0,1,2,3}] [--kill-in-save STEP:RANK:POINT]
                         [--kill-in-background-write STEP:N]
                         [--zero-offload-dir DIR [--kill-in-offload-step STEP:RANK:WINDOW:POINT]
                          [--offload-report DIR]]
                         [--signal-after-step N --signal NAME [--signal-rank R]
                          [--signal-count C] [--signal-launcher]]

120 samples over 2 ranks in micro-batches of 4 with 2-step accumulation is
15 micro-batches, so 8 optimizer steps, per epoch (the last step of each epoch
has one micro-batch): 20 steps cross two epoch boundaries. With
--kill-after-step N, rank 0 (or --kill-rank) SIGKILLs itself at the first
micro-batch after step N, a real crash mid-run; the launcher then stops the other rank. With
--kill-on-first-attempt-only it does so only when the launcher has not
restarted the job yet (PHALANX_RESTART_COUNT 0), so `--max-restarts 1` brings
the job back, and `--resume` carries it on from the last checkpoint.
With --kill-in-save, rank RANK
SIGKILLs itself inside the save of checkpoint-STEP (faultkit.py says where).
With --kill-in-background-write STEP:N the process SIGKILLs itself at
event N of checkpoint-STEP's background write (N = -1: counts them), writing
OUTPUT_DIR.killed first (faultkit.py says how).
With --signal-after-step N, rank R sends itself (or, with --signal-launcher,
its parent, the launcher) the signal C times during step N + 1.
With --zero-stage 1 or 2 the Trainer shards its AdamW (and the checkpoints); with 3 the model too.
With --zero-offload-dir its state goes to files there (zero_offload="disk", a window so small
that each tensor is one); --kill-in-offload-step has rank RANK SIGKILL itself inside the
optimizer step STEP, at window WINDOW (faultkit.py says where), first writing
OUTPUT_DIR.killed; --offload-report has each rank write DIR/rank<r>.json: which offload
files it maps or holds open once trained (faultkit.offload_report).
Rank 0 writes the final parameters to RESULT_FILE and a summary beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from faultkit import (
    kill_in_background_write,
    kill_in_offload_step,
    kill_in_save,
    offload_report,
    signal_in_step,
)
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx import zero3
from phalanx.train import Trainer, TrainingArguments

SAMPLES = 120


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=gen)
    return TensorDataset(x, (x[:, :3].sum(1) * 2).long().clamp(-1, 1) + 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("result")
    parser.add_argument("--kill-after-step", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-in-save", default="")
    parser.add_argument("--kill-in-background-write", default="")
    parser.add_argument("--signal-after-step", type=int, default=0)
    parser.add_argument("--signal", default="SIGTERM")
    parser.add_argument("--signal-rank", type=int, default=0)
    parser.add_argument("--signal-count", type=int, default=1)
    parser.add_argument("--signal-launcher", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--kill-on-first-attempt-only", action="store_true")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    parser.add_argument("--zero-offload-dir", default=None)
    parser.add_argument("--kill-in-offload-step", default="")
    parser.add_argument("--offload-report", default="")
    opts = parser.parse_args()
    offload: dict[str, Any] = {}
    if opts.zero_offload_dir:
        offload = {
            "zero_offload": "disk",
            "zero_offload_dir": opts.zero_offload_dir,
            "zero_offload_window_mb": 0.001,
        }
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        save_steps=opts.save_steps,
        logging_steps=4,
        report_to=["jsonl"],
        disable_tqdm=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        zero_stage=opts.zero_stage,
        **offload,
    )
    torch.manual_seed(0)
    model = DropoutMLP()
    trainer: Trainer

    def loss_fn(outputs: Tensor, batch: Any) -> Tensor:
        crash_here = trainer.state.global_step == opts.kill_after_step > 0
        if opts.kill_on_first_attempt_only:
            crash_here = crash_here and os.environ.get("PHALANX_RESTART_COUNT", "0") == "0"
        if crash_here and trainer.world.rank == opts.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        signal_in_step(trainer, opts)
        return nn.functional.cross_entropy(outputs, batch[1])

    trainer = Trainer(model=model, args=args, train_dataset=dataset(), loss_fn=loss_fn)
    if opts.kill_in_save:
        kill_in_save(trainer, opts.kill_in_save)
    if opts.kill_in_background_write:
        marker = Path(opts.output_dir).with_suffix(".killed")
        kill_in_background_write(trainer, opts.kill_in_background_write, marker)
    if opts.kill_in_offload_step:
        marker = Path(opts.output_dir).with_suffix(".killed")
        kill_in_offload_step(trainer, opts.kill_in_offload_step, marker)
    result = trainer.train(resume_from_checkpoint=True if opts.resume else None)
    if opts.offload_report:
        Path(opts.offload_report).mkdir(parents=True, exist_ok=True)
        offload_report(trainer, Path(opts.offload_report) / f"rank{trainer.world.rank}.json")
    # Stage 3's model holds pieces: gather the whole parameters (every rank takes part).
    state = zero3.full_state_dict(trainer.model) if opts.zero_stage == 3 else None
    if trainer.world.rank == 0:
        torch.save(state if state is not None else trainer.model.state_dict(), opts.result)
        summary = {
            "global_step": result.global_step,
            "resumed_from": result.resumed_from,
            "train_loss": result.train_loss,
        }
        Path(opts.result).with_suffix(".json").write_text(json.dumps(summary))
        print(f"done: {summary}", flush=True)


if __name__ == "__main__":
    main()
