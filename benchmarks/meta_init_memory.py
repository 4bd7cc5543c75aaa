"""Peak host memory of the Trainer at stage 3 when the model is built on the meta device,
against the same model built on the CPU (and stage 0), 2 ranks, each variant fresh processes.

The issue-23 model: an MLP of twelve 2500x2500 Linears (75M parameters, 1.2 GB of
parameters, gradients and Adam state whole). Built on the CPU, every rank holds
the whole model until fully_shard has cut it; built under torch.device("meta"),
the Trainer shards it first and each rank materialises only its shards
(phalanx/zero3/meta_init.py), one module's full tensors at a time. Per rank:
peak RSS once the Trainer is made (the build's peak) and after the steps
(training's), and the training state each rank holds (unique storages).

    python benchmarks/meta_init_memory.py               # ~2 minutes on 2 cores
    python benchmarks/meta_init_memory.py --layers 4    # a quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spawn import run_ranks

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "meta_init_memory.json"
VARIANTS = ("stage 3, built on the meta device", "stage 3, built on the CPU", "stage 0 (DDP)")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_main(
    rank: int, world: int, variant: str, layers: int, width: int, steps: int, out_dir: str
) -> Any:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import phalanx

    def build() -> nn.Module:
        torch.manual_seed(0)
        body: list[nn.Module] = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.Tanh()]
        return _batched(nn.Sequential(*body))

    start = _peak_mb()
    if "meta" in variant:
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    data = TensorDataset(torch.randn(64, width), torch.randn(64, width))
    args = phalanx.TrainingArguments(
        output_dir=out_dir,
        zero_stage=0 if "stage 0" in variant else 3,
        max_steps=steps,
        per_device_train_batch_size=8,
        save_steps=10_000,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    trainer = phalanx.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )
    del model
    built = _peak_mb()
    trainer.train()
    state = _state_mb(trainer)
    trainer.close()
    return {"start_mb": start, "built_mb": built, "peak_mb": _peak_mb(), "state_mb": state}


def _batched_class() -> Any:
    from torch import nn

    class Batched(nn.Module):
        """The Trainer hands the model its batch: (inputs, targets)."""

        def __init__(self, body: nn.Module) -> None:
            super().__init__()
            self.body = body

        def forward(self, batch: Any) -> Any:
            return self.body(batch[0])

    return Batched


def _batched(body: Any) -> Any:  # a class made on demand: no torch at import
    return _batched_class()(body)


def _state_mb(trainer: Any) -> float:
    import torch

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if torch.is_tensor(t):
            t = getattr(t, "_local_tensor", t)
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in trainer.model.parameters():
        add(p)
        add(p.grad)
    for s in trainer.optimizer.state.values():
        for v in s.values():
            add(v)
    return sum(seen.values()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    opts = parser.parse_args(argv)
    results: dict[str, Any] = {
        "model": f"MLP of {opts.layers} {opts.width}x{opts.width} Linears",
        "parameters": opts.layers * (opts.width * opts.width + opts.width),
        "world": 2,
        "variants": {},
    }
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory(prefix="meta-init-") as out_dir:
            ranks = run_ranks(rank_main, 2, variant, opts.layers, opts.width, opts.steps, out_dir)
        results["variants"][variant] = ranks
        worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
        print(
            f"{variant:36s} built {worst['built_mb']:7.0f} MB  peak {worst['peak_mb']:7.0f} MB  "
            f"state {worst['state_mb']:6.0f} MB  (before the model {worst['start_mb']:.0f} MB)",
            flush=True,
        )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
