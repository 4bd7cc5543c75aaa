"""A tiny GPT-2 built from a config (no download), trained by the Trainer on dict batches.

Usage: trainer_hf.py OUTPUT_DIR RESULT_JSON

Batches are {"input_ids", "labels"} dicts, so the Trainer must call
`model(**batch)`; GPT-2 computes its own loss from the labels. The sequences
count upwards modulo the vocabulary, a pattern a small model learns in a few
steps. Gradient checkpointing is on, through the model's own
`gradient_checkpointing_enable()`. Rank 0 writes the eval loss before and after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import phalanx
from phalanx.train import Trainer, TrainingArguments

VOCAB = 100
LENGTH = 24


class CountingSequences(Dataset[dict[str, Tensor]]):
    def __init__(self, count: int, offset: int) -> None:
        self.count, self.offset = count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        start = (index * 7 + self.offset) % VOCAB
        ids = (torch.arange(LENGTH) + start) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def main(output_dir: str, result: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=4,
        save_steps=0,
        gradient_checkpointing=True,
        report_to=["jsonl", "csv"],
        disable_tqdm=True,
        ddp_backend="gloo",
        ddp_timeout=60,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=CountingSequences(96, 0),
        eval_dataset=CountingSequences(21, 3),
    )
    before = trainer.evaluate()
    out = trainer.train()
    after = trainer.evaluate()
    if trainer.world.rank == 0:
        record = {
            "world_size": trainer.world.world_size,
            "global_step": out.global_step,
            "before": before,
            "after": after,
            "train_loss": out.train_loss,
            "model_class": type(trainer.model).__name__,
            "wrapped_class": type(trainer.wrapped_model).__name__,
        }
        Path(result).write_text(json.dumps(record))
        print(json.dumps(record), flush=True)
    phalanx.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
