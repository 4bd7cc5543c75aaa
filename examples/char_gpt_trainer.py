"""A tiny character-level GPT trained with phalanx's Trainer: dict batches, model(**batch).

The text is examples/char_gpt.py's corpus, the Python standard library's own
source (no download). The model reads `input_ids` and `labels` as keyword
arguments and returns its own loss, as Hugging Face models do, so the Trainer
needs no loss_fn; it also has `gradient_checkpointing_enable()`, so
`--gradient_checkpointing` works.

    python examples/char_gpt_trainer.py --max_steps 300
    phalanx launch --nproc-per-node 2 examples/char_gpt_trainer.py --max_steps 300
    torchrun --nproc-per-node 2 examples/char_gpt_trainer.py --bf16

Every TrainingArguments field is a flag; rerunning the same command resumes
from the newest checkpoint in --output_dir (--no-resume --overwrite_output_dir
starts over).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from char_gpt import VOCAB, decode, encode, read_stdlib  # examples/char_gpt.py, beside this file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

import phalanx
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.checkpoint.directory import list_checkpoints
from phalanx.train.logging.metrics import CSV_NAME, JSONL_NAME

# Small enough for a laptop CPU: 64 characters of context, 4 heads of 16, 2 layers.
BLOCK = 64
EMBED = 64
HEADS = 4
LAYERS = 2
# Windows start every 32 characters, half a context: each character is in two windows.
STRIDE = 32
# 200 kB of the standard library: a few seconds per epoch on a CPU.
CORPUS_BYTES = 200_000
# The last tenth of the text is held out for evaluation.
EVAL_FRACTION = 0.1
DEFAULTS = {
    "output_dir": "runs/char_gpt_trainer",
    "max_steps": 400,
    "learning_rate": 3e-3,
    "warmup_steps": 40,
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.1,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "logging_steps": 50,
    "eval_steps": 100,
    "save_steps": 100,
    "save_total_limit": 2,
    "seed": 0,
}


class CharWindows(Dataset[dict[str, Tensor]]):
    """Overlapping windows of the text; labels are the inputs shifted by one character."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return max(0, (len(self.ids) - BLOCK - 1) // STRIDE + 1)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        chunk = self.ids[index * STRIDE : index * STRIDE + BLOCK + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED)
        )

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, EMBED)
        self.positions = nn.Embedding(BLOCK, EMBED)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, vocab_size)
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block in backward instead of keeping its activations."""
        self.checkpointing = True

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out

    @torch.no_grad()
    def generate(self, ids: Tensor, length: int) -> Tensor:
        for _ in range(length):
            logits = self(ids[:, -BLOCK:])["logits"][:, -1]
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return ids


def parse() -> tuple[TrainingArguments, argparse.Namespace]:
    args, rest = TrainingArguments.from_cli_known(defaults=DEFAULTS)
    own = argparse.ArgumentParser(description="a character GPT with the phalanx Trainer")
    own.add_argument("--corpus_bytes", type=int, default=CORPUS_BYTES)
    own.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    own.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    return args, own.parse_args(rest)


def report_where_written(output_dir: Path, report_to: list[str]) -> None:
    saved = list_checkpoints(output_dir)
    print(f"checkpoint: {saved[0][1].resolve() if saved else 'none (save_steps=0)'}")
    for name, file in (("jsonl", JSONL_NAME), ("csv", CSV_NAME)):
        if name in report_to:
            print(f"metrics: {(output_dir / file).resolve()}")


def main() -> None:
    args, opts = parse()
    ids = encode(read_stdlib(opts.corpus_bytes))
    split = int(len(ids) * (1 - EVAL_FRACTION))
    torch.manual_seed(args.seed)
    model = CharGPT(len(VOCAB))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=CharWindows(ids[:split]),
        eval_dataset=CharWindows(ids[split:]),
    )
    result = trainer.train(resume_from_checkpoint=opts.resume)
    metrics = trainer.evaluate()
    if trainer.world.is_main:
        print(
            f"world size {trainer.world.world_size}, step {result.global_step}, "
            f"train loss {result.train_loss:.4f}, eval loss {metrics['eval_loss']:.4f}, "
            f"{result.samples_per_second * BLOCK:.0f} tokens/s"
        )
        if opts.sample > 0:
            model.eval()
            prompt = ids[split : split + 16].unsqueeze(0).to(trainer.world.device)
            sample = trainer.model.generate(prompt, opts.sample)[0].tolist()  # type: ignore[operator]
            print("sample:\n" + decode(sample))
        report_where_written(Path(args.output_dir), args.report_to)
    phalanx.shutdown()


if __name__ == "__main__":
    try:
        main()
    except phalanx.PhalanxError as exc:  # a mistake of ours or yours: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
