"""Train a small character-level GPT on the Python standard library's own source.

Every Python installation carries a few megabytes of real, varied text: the
`*.py` files of its standard library. We read a deterministic, sorted subset
of them, train a nanoGPT-style transformer to predict the next character, and
watch the validation loss fall. Each rank trains on its own shard of the
windows; phalanx averages the gradients.

    python examples/char_gpt.py                                    # one process
    phalanx launch --nproc-per-node 2 examples/char_gpt.py         # two ranks
    torchrun --nproc-per-node 2 examples/char_gpt.py               # the same script under torchrun

The defaults (500 steps, 2M characters seen) take the validation loss from
ln(98) = 4.6, a uniform guess, to about 2.0: about five minutes on two CPU
ranks. The sample then looks like Python written by someone who has only heard
of it. For a quick look: `--steps 50 --n-layer 2 --n-embd 64`.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx

# 2 MB is about the first 60 modules alphabetically: enough text that the model
# does not memorise it in a few hundred steps, small enough to read instantly.
CORPUS_BYTES = 2_000_000
VAL_FRACTION = 0.1  # the tail of the corpus, so validation text is never trained on
# Tab, newline and printable ASCII cover nearly all of the stdlib; anything else
# becomes one "unknown" id. A fixed vocabulary is the same on every rank and machine.
VOCAB = "\x00\t\n" + "".join(chr(c) for c in range(32, 127))
BLOCK_SIZE = 128  # characters of context: a few lines of code
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128  # ~0.8M parameters: trains on CPU in minutes
GLOBAL_BATCH = 32  # sequences per step across all ranks, split between them
LEARNING_RATE = 2e-3  # AdamW; small transformers tolerate a higher rate than GPT-2's 6e-4
WARMUP_STEPS = 20  # linear warm-up keeps the first, noisy Adam steps from blowing up
STEPS = 500
EVAL_INTERVAL = 100
EVAL_WINDOWS = 64  # validation windows scored per evaluation (8k characters at BLOCK_SIZE)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--batch-size", type=int, default=GLOBAL_BATCH, help="across all ranks")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--n-layer", type=int, default=N_LAYER)
    parser.add_argument("--n-head", type=int, default=N_HEAD)
    parser.add_argument("--n-embd", type=int, default=N_EMBD)
    parser.add_argument("--corpus-bytes", type=int, default=CORPUS_BYTES)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    parser.add_argument("--eval-interval", type=int, default=EVAL_INTERVAL)
    parser.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS)
    parser.add_argument("--sample-chars", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("runs/examples/char_gpt.pt"))
    return parser.parse_args()


# ----------------------------------------------------------------------------- data


def read_stdlib(limit: int) -> str:
    """The first `limit` bytes of the stdlib's top-level modules, in sorted order.

    Sorted paths make the corpus identical on every rank (and every run) of
    the same Python; each file is prefixed with its name to mark the seams.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = f"# file: {path.name}\n" + path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[: limit - size])
        size += len(parts[-1])
        if size >= limit:
            break
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    lookup = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([lookup.get(ch, 0) for ch in text], dtype=torch.long)


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] if i > 0 else "?" for i in ids)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of the text: input characters and the ones that follow."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


# ---------------------------------------------------------------------------- model


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block, as in GPT-2: attention then a 4x-wide MLP."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(len(VOCAB), n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, len(VOCAB), bias=False)
        for module in self.modules():  # GPT-2's init: small weights keep early logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.tok(ids) + self.pos(positions))
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Sample `n` more characters at temperature 0.8 (less random than the raw model)."""
        for _ in range(n):
            logits = self(ids[:, -self.block_size :])[:, -1] / 0.8
            next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
        return ids


# ------------------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak (nanoGPT's schedule)."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def validation_loss(model: nn.Module, val: Windows, windows: int, world: phalanx.World) -> float:
    """Mean loss over the first `windows` validation windows, each scored by one rank."""
    subset = torch.utils.data.Subset(val, range(min(windows, len(val))))
    sampler = phalanx.DistributedSampler(subset, shuffle=False, pad=False)
    total = torch.zeros(2, dtype=torch.float64)  # summed loss, token count
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(subset, batch_size=16, sampler=sampler):
            logits = model(x.to(world.device))
            loss = F.cross_entropy(
                logits.flatten(0, 1), y.to(world.device).flatten(), reduction="sum"
            )
            total += torch.tensor([loss.item(), y.numel()], dtype=torch.float64)
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def batches(
    loader: DataLoader, sampler: phalanx.DistributedSampler
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches; each pass over the data is a new epoch with a new shuffle."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def save(model: nn.Module, args: argparse.Namespace) -> None:
    """Weights plus what is needed to rebuild the model; written atomically by rank 0."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("block_size", "n_layer", "n_head", "n_embd")}
    partial = args.out.with_suffix(args.out.suffix + ".partial")
    torch.save({"model": model.state_dict(), "config": config, "vocab": VOCAB}, partial)
    os.replace(partial, args.out)


def main() -> None:
    args = parse_args()
    world = phalanx.init()
    torch.manual_seed(args.seed)
    ids = encode(read_stdlib(args.corpus_bytes))
    split = int(len(ids) * (1 - VAL_FRACTION))
    train, val = Windows(ids[:split], args.block_size), Windows(ids[split:], args.block_size)
    per_rank_batch = max(1, args.batch_size // world.world_size)
    sampler = phalanx.DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=per_rank_batch, sampler=sampler, drop_last=True)

    net = CharGPT(args.block_size, args.n_layer, args.n_head, args.n_embd).to(world.device)
    model = phalanx.DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    tokens_per_step = per_rank_batch * args.block_size * world.world_size
    if world.is_main:
        n_params = sum(p.numel() for p in net.parameters())
        print(
            f"world size {world.world_size}, {world.backend} on {world.device}; corpus "
            f"{len(ids):,} chars ({len(train)} train / {len(val)} val windows); "
            f"{n_params / 1e6:.2f}M parameters; {tokens_per_step:,} tokens per step"
        )

    first_val = validation_loss(net, val, args.eval_windows, world)
    if world.is_main:
        print(f"step {0:5d} | val loss {first_val:.4f}")
    val_loss, train_time, last_step = first_val, 0.0, 0
    stream = batches(loader, sampler)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args.steps, args.lr)
        x, y = next(stream)
        logits = model(x.to(world.device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(world.device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # phalanx all-reduces the gradients, bucket by bucket, during this call
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        train_time += time.perf_counter() - started
        if step % args.eval_interval == 0 or step == args.steps:
            val_loss = validation_loss(net, val, args.eval_windows, world)
            rate = tokens_per_step * (step - last_step) / max(train_time, 1e-9)
            train_time, last_step = 0.0, step
            if world.is_main:
                print(
                    f"step {step:5d} | train loss {loss.item():.4f} | val loss {val_loss:.4f} "
                    f"| {rate:,.0f} tokens/s"
                )

    if world.is_main:
        verdict = "fell" if val_loss < first_val else "did not fall"
        print(f"validation loss {verdict}: {first_val:.4f} -> {val_loss:.4f}")
        prompt = encode("def ").unsqueeze(0).to(world.device)
        generator = torch.Generator(device=world.device).manual_seed(args.seed)
        sample = net.eval().generate(prompt, args.sample_chars, generator)
        print("sample:\n" + decode(sample[0].tolist()))
        save(net, args)
        print(f"saved {args.out}")
    phalanx.shutdown()


if __name__ == "__main__":
    main()
