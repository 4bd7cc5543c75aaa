"""A restart at the same and at another world size: time to the first step, and the bytes
each rank reads against the bytes it holds, with phalanx's reader against torch's.

Two gloo ranks, and then three, train a stage-3 Trainer (async_save.py's model,
`--width` x `--layers`, AdamW) for `--steps` steps and save the last one in the
background (collective-free, dcp_local.py). Then fresh ranks resume them,
`--rounds` times in a balanced order: 2 -> 2, 2 -> 3 and 3 -> 2, each with two
readers: phalanx's
(runtime/dcp_ranges.py: of each item the rows a rank holds) and torch's
`FileSystemReader.read_data` (each item it touches, whole). Reported per case,
the worst rank: the seconds from the Trainer's construction to the start of its
first step (the restart's cost, imports apart), and bytes read / bytes held.
Writes docs/results/async_resume.json.

    python benchmarks/async_resume.py              # ~4 minutes on 2 cores
    python benchmarks/async_resume.py --tiny       # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_save import _model
from interleave import balanced_order
from spawn import run_ranks

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results" / "async_resume.json"
READERS = ("phalanx", "torch")


def _trainer(cfg: dict[str, Any], out: Path, max_steps: int, save_steps: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    from phalanx.train import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64 * cfg["batch"] * 3, cfg["width"], generator=gen)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=save_steps,
        per_device_train_batch_size=cfg["batch"],
        zero_stage=3,
        logging_steps=100_000,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
        ddp_timeout=600,
    )
    return Trainer(
        model=_model(cfg["width"], cfg["layers"]),
        args=args,
        train_dataset=TensorDataset(x, x.flip(1)),
        loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]),
    )


def _save(rank: int, world: int, cfg: dict[str, Any]) -> None:
    steps = cfg["steps"]
    _trainer(cfg, Path(cfg["root"]) / f"run-{world}", steps, steps).train()


def _resume(
    rank: int, world: int, cfg: dict[str, Any], saved_by: int, reader: str, tag: str
) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    from phalanx.runtime import safe_dcp

    read: list[int] = []
    ours = safe_dcp.SafeReader.read_data

    def counted(self: Any, plan: Any, planner: Any) -> Any:
        if reader == "phalanx":
            before = self.bytes_read
            done = ours(self, plan, planner)
            read.append(self.bytes_read - before)
            return done
        infos = (self.storage_data[i.storage_index] for i in plan.items)
        items = {(info.relative_path, info.offset, info.length) for info in infos}
        read.append(sum(length for _, _, length in items))  # torch reads whole items
        return FileSystemReader.read_data(self, plan, planner)

    safe_dcp.SafeReader.read_data = counted  # type: ignore[method-assign]
    started = time.perf_counter()
    steps = cfg["steps"]
    trainer = _trainer(cfg, Path(cfg["root"]) / f"resumed-{tag}", steps + 1, 0)
    first: list[float] = []
    run = trainer.setup.stepper.run

    def step(*args: Any, **kwargs: Any) -> Any:
        first.append(time.perf_counter() - started)
        return run(*args, **kwargs)

    trainer.setup.stepper.run = step
    saved = Path(cfg["root"]) / f"run-{saved_by}" / f"checkpoint-{steps}"
    trainer.train(resume_from_checkpoint=str(saved))
    held = sum(getattr(p, "_local_tensor", p).nbytes for p in trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        held += sum(getattr(v, "_local_tensor", v).nbytes for v in state.values())
    return {"first_step_s": first[0], "read": sum(read), "held": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.width, opts.layers, opts.rounds = 64, 2, 1
    root = Path(tempfile.mkdtemp(prefix="async-resume-", dir=os.environ.get("BENCH_DIR")))
    cfg = {k: v for k, v in vars(opts).items() if k != "out"} | {"root": str(root)}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        run_ranks(_save, 2, cfg)
        run_ranks(_save, 3, cfg)
        moves = [(2, 2), (2, 3), (3, 2)]
        cases = [(move, reader) for move in moves for reader in READERS]
        for r in range(opts.rounds):
            for (saved_by, world), reader in balanced_order(r, cases):
                tag = f"{reader}-{saved_by}-{world}-{r}"
                ranks = run_ranks(_resume, world, cfg, saved_by, reader, tag)
                runs.setdefault(f"{saved_by} -> {world}, {reader}", []).append(
                    {
                        "first_step_s": max(x["first_step_s"] for x in ranks),
                        "read_over_held": max(x["read"] / x["held"] for x in ranks),
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, Any] = {"config": cfg | {"root": None}}
    for case, values in runs.items():
        results[case] = {k: statistics.median(v[k] for v in values) for k in values[0]}
        print(f"{case}: {json.dumps(results[case])}", flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
