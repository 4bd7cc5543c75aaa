"""How long a checkpoint blocks the Trainer's loop: a background save against a save written
there and then, and against torch's own `dcp.async_save` of the same state.

Two gloo ranks (`--nproc`) train a stack of `--layers` Linear(W, W) blocks with AdamW (W =
`--width`; 2048 x 6: 25M parameters, 100 MB, 300 MB with Adam's state) under
each `--stages` entry: 0, 1, 3, and 3 with disk offload (`3d`). Every
`--every` steps one save is made, the variants in interleaved rounds (a
balanced order, interleave.py):

- `sync`: the Trainer's save with save_async=False (the loop waits for the disk);
- `async`: the Trainer's background save (save_async=True);
- `torch`: torch's `dcp.async_save` of the same entries (the sharded ones'
  DCP state dicts, the replicated ones' state dicts, each rank's own RNG
  state) over a gloo group of its own, as its docs advise.

The writers' gloo group, which the first background save makes (a
collective), is made before training, its time reported apart. Before each
save every earlier write is finished (outside the timing), so a save's stall is
its own: the seconds from the save's start until the loop may take its next
step (`Trainer._save`, or `dcp.async_save`'s return). Under disk offload the
background save copies nothing of the offloaded state at the step (it holds
it in its files: offload/held.py): reported are the bytes held and the share
of them the next step reached first and copied aside. Reported
per variant: the median stall and its ratio to sync's (for `async`, the part
spent in the checkpointer's stage: the per-rank gather, the staging folder's
name and the copy); the seconds until the
write is complete; the step time (the step's forward, backward and optimizer,
`StepRunner.run`) of the steps taken while a write was in flight against those
taken with none; and the extra peak RSS from the save's start until its write
is complete (the kernel's peak mark, reset at the start) beside that of a quiet
stretch as long, and the bytes the rank copied (its part of the state).

It also runs async_staging.py's measurements (one process): the host copy
against a copy-on-write fork and a reused buffer, and a writer thread against
a writer process. Everything goes to `--out` (docs/results/async_save.json).

    python benchmarks/async_save.py                  # ~6 minutes on 2 cores
    python benchmarks/async_save.py --tiny           # seconds: checks the script runs
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

import async_staging
from interleave import balanced_order
from spawn import run_ranks

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results" / "async_save.json"
VARIANTS = ("sync", "async", "torch")
STAGES = {"0": (0, None), "1": (1, None), "3": (3, None), "3d": (3, "disk")}


def _status(key: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    """Reset the kernel's peak-RSS mark to the RSS now; that RSS."""
    with open("/proc/self/clear_refs", "w") as marks:
        marks.write("5")
    return _status("VmRSS")


def _model(width: int, layers: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.linear(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            return self.blocks(batch[0])

    torch.manual_seed(0)
    return Net()


class TorchAsync:
    """The `torch` variant: dcp.async_save of the Trainer's entries over its own group."""

    def __init__(self, trainer: Any, root: Path) -> None:
        import torch.distributed as dist

        self.trainer = trainer
        self.root = root
        self.group = dist.new_group(backend="gloo")
        self.future: Any = None

    def state(self) -> dict[str, Any]:
        from phalanx.train.checkpoint.stateful import placement_of

        rank = self.trainer.world.rank
        state: dict[str, Any] = {}
        for name, entry in self.trainer.checkpoint_states().items():
            placement = placement_of(entry)
            if placement == "sharded":
                state[name] = entry.sharded_state_dict()
            elif placement == "replicated":
                state[name] = entry.state_dict()
            else:  # each rank's own, under a key of its own
                state[f"{name}_rank{rank}"] = entry.state_dict()
        return state

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.trainer.setup.settle_loss()  # what the Trainer's save does first, for a fair start
        where = self.root / f"torch-{step}"
        state, group = self.state(), self.group
        self.future = dcp.async_save(state, checkpoint_id=str(where), process_group=group)
        self.future.add_done_callback(lambda _: self.on_done())

    def on_done(self) -> None:
        """Replaced by the Probe: when the write completed."""

    def writing(self) -> bool:
        return self.future is not None and not self.future.done()

    def settle(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        for old in self.root.glob("torch-*"):
            shutil.rmtree(old, ignore_errors=True)


class Probe:
    """Times the loop's saves and steps in one rank's Trainer (module docstring)."""

    def __init__(self, trainer: Any, root: Path, rounds: int) -> None:
        self.trainer = trainer
        self.torch = TorchAsync(trainer, root)
        self.schedule = [v for r in range(rounds) for v in balanced_order(r, list(VARIANTS))]
        self.saves: list[dict[str, Any]] = []
        self.steps: dict[str, list[float]] = {"quiet": [], "async": [], "torch": []}
        self.pending: dict[str, Any] | None = None
        self.staged_bytes = 0
        """What this rank's last background save copied (its part of the state)."""
        self.holds: list[Any] = []
        """Each background save's SaveHold (disk offload): what it held, what it copied aside."""
        self.stage_s: list[float] = []
        """Of each background save's stall, the copy's share (the collectives around it too)."""
        self.done_at = 0.0
        """When the last write completed (the writer thread, or torch's future, says)."""
        self._save = trainer._save
        self._run = trainer.setup.stepper.run
        trainer._save = self.save
        trainer.setup.stepper.run = self.step
        self.torch.on_done = self.mark_done  # type: ignore[method-assign]
        writer = trainer.setup.checkpointer.background
        start = writer.start

        def timed_start(step: int, write: Any) -> None:
            def timed() -> Any:
                saved = write()
                self.mark_done()
                return saved

            start(step, timed)

        writer.start = timed_start

    def mark_done(self) -> None:
        self.done_at = time.perf_counter()

    def writing(self) -> str | None:
        writer = self.trainer.setup.checkpointer.background
        if writer.in_flight and not writer.done():
            return "async"
        return "torch" if self.torch.writing() else None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        kind = self.writing() or "quiet"
        start = time.perf_counter()
        out = self._run(*args, **kwargs)
        self.steps[kind].append(time.perf_counter() - start)
        return out

    def settle(self) -> None:
        """Finish every write (outside the timing) and record the last save's write."""
        import torch.distributed as dist

        self.trainer.saves.collect()
        self.torch.settle()
        dist.barrier()
        if self.pending is not None:
            started = self.pending.pop("started")
            done = self.done_at if self.pending["variant"] != "sync" else started
            self.pending["written_s"] = max(done - started, self.pending["stall_s"])
            self.pending["peak_extra"] = _status("VmHWM") - self.pending.pop("rss")
            self.saves.append(self.pending)
            self.pending = None

    def save(self, background: bool) -> Path:
        step = self.trainer.state.global_step
        self.settle()
        variant = self.schedule[len(self.saves)] if len(self.saves) < len(self.schedule) else "sync"
        rss = _reset_peak()
        started = time.perf_counter()
        if variant == "torch":
            self.torch.save(step)
            path = self.torch.root
        else:
            path = self._save(background=variant == "async")
        stall = time.perf_counter() - started
        self.pending = {"variant": variant, "stall_s": stall, "started": started, "rss": rss}
        return path


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import TensorDataset

    from phalanx.train import Trainer, TrainingArguments

    if cfg.get("writer_policy") == "idle":  # an experiment: the writer runs only on idle CPU
        import threading

        import phalanx.train.checkpoint.background as background

        def idle() -> None:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))

        background._lower_priority = idle
    root = Path(cfg["root"]) / f"stage{cfg['stage']}"
    stage, offload = STAGES[cfg["stage"]]
    extra: dict[str, Any] = {}
    if offload:
        extra = {"zero_offload": offload, "zero_offload_dir": str(root / "offload")}
    saves = cfg["rounds"] * len(VARIANTS)
    steps = (saves + 1) * cfg["every"]
    gen = torch.Generator().manual_seed(1)
    samples = steps * cfg["batch"] * world
    x = torch.randn(samples, cfg["width"], generator=gen)
    settings: dict[str, Any] = {
        "output_dir": str(root / "run"),
        "max_steps": steps,
        "save_steps": cfg["every"],
        "save_total_limit": 1,
        "per_device_train_batch_size": cfg["batch"],
        "zero_stage": stage,
        "logging_steps": 100_000,
        "report_to": [],
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 600,
    }
    args = TrainingArguments(**settings, **extra)
    trainer = Trainer(
        model=_model(cfg["width"], cfg["layers"]),
        args=args,
        train_dataset=TensorDataset(x, x.flip(1)),
        loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]),
    )
    probe = Probe(trainer, root, cfg["rounds"])
    checkpointer = trainer.setup.checkpointer
    checkpointer.start_background = _counting(checkpointer, probe)  # type: ignore[method-assign]
    quiet = _quiet_peak(trainer, probe, cfg["every"])
    started = time.perf_counter()  # the writers' group, made at the first background save
    trainer.setup.checkpointer.background.writers_world(600)
    group_s = time.perf_counter() - started
    trainer.train()
    probe.settle()
    return {
        "saves": probe.saves,
        "steps": probe.steps,
        "quiet_peak": quiet,
        "group_s": group_s,
        "staged_bytes": probe.staged_bytes,
        "stage_s": probe.stage_s,
        "held": [(hold.held_bytes, hold.aside_bytes) for hold in probe.holds],
    }


def _counting(checkpointer: Any, probe: Probe) -> Any:
    """start_background that also records the bytes this rank copied."""
    start = checkpointer.start_background

    def start_background(*args: Any, **kwargs: Any) -> Any:
        staged = start(*args, **kwargs)
        probe.staged_bytes = staged.bytes
        if staged.hold is not None:  # disk offload: the files written from, uncopied
            probe.holds.append(staged.hold)
        probe.stage_s.append(staged.blocked_s)
        return staged

    return start_background


def _quiet_peak(trainer: Any, probe: Probe, steps: int) -> dict[str, int]:
    """Peak RSS above the start over the first `steps` steps of training (no save)."""
    marks: dict[str, int] = {}
    run = probe.step

    def step(*args: Any, **kwargs: Any) -> Any:
        done = trainer.state.global_step
        if done == 1:  # after the first step: its allocations are the steady state's
            marks["rss"] = _reset_peak()
        out = run(*args, **kwargs)
        if done == steps - 1 and "rss" in marks:
            marks["peak_extra"] = _status("VmHWM") - marks["rss"]
        return out

    trainer.setup.stepper.run = step
    return marks


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per variant (the worst rank's), and the ratios the docs quote."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        saves = [[s for s in r["saves"] if s["variant"] == variant] for r in ranks]
        out[variant] = {
            "stall_s": max(statistics.median(s["stall_s"] for s in rs) for rs in saves),
            "written_s": max(statistics.median(s["written_s"] for s in rs) for rs in saves),
            "peak_extra_mb": max(max(s["peak_extra"] for s in rs) for rs in saves) / 2**20,
            "saves": len(saves[0]),
        }
    quiet = [statistics.median(r["steps"]["quiet"]) for r in ranks]
    for variant in ("async", "torch"):
        during = [statistics.median(r["steps"][variant] or [float("nan")]) for r in ranks]
        out[variant]["step_while_writing"] = max(d / q for d, q in zip(during, quiet))
        out[variant]["steps_while_writing"] = min(len(r["steps"][variant]) for r in ranks)
        out[variant]["stall_vs_sync"] = out[variant]["stall_s"] / out["sync"]["stall_s"]
    out["quiet_peak_extra_mb"] = max(r["quiet_peak"].get("peak_extra", 0) for r in ranks) / 2**20
    out["staged_mb"] = [r["staged_bytes"] / 2**20 for r in ranks]
    out["quiet_step_s"] = max(quiet)
    out["writers_group_s"] = max(r["group_s"] for r in ranks)
    out["async"]["of_which_stage_s"] = max(statistics.median(r["stage_s"]) for r in ranks)
    if all(r["held"] for r in ranks):
        out["held_mb"] = [statistics.median(h for h, _ in r["held"]) / 2**20 for r in ranks]
        shares = [statistics.median(a / h for h, a in r["held"] if h) for r in ranks]
        out["copied_aside_share"] = max(shares)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=20, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--stages", default="0,1,3,3d")
    parser.add_argument("--staging-mb", type=int, default=300)
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks (one thread each): 1 leaves a core of this 2-core machine to the writer",
    )
    parser.add_argument("--tiny", action="store_true", help="a check that it runs")
    parser.add_argument(
        "--writer-policy",
        choices=("nice", "idle"),
        default="nice",
        help="the writer thread niced (phalanx's) or under SCHED_IDLE (an experiment)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.width, opts.layers, opts.every, opts.rounds, opts.staging_mb = 64, 2, 4, 1, 4
    root = Path(tempfile.mkdtemp(prefix="async-save-", dir=os.environ.get("BENCH_DIR")))
    results: dict[str, Any] = {"config": {k: v for k, v in vars(opts).items() if k != "out"}}
    try:
        for stage in opts.stages.split(","):
            cfg = {**vars(opts), "root": str(root), "stage": stage}
            cfg.pop("out")
            ranks = run_ranks(_rank, opts.nproc, cfg)
            results[f"stage {stage}"] = summary = summarize(ranks)
            print(f"stage {stage}: {json.dumps(summary)}", flush=True)
        results["staging"] = async_staging.measure(opts.staging_mb, rounds=3 if opts.tiny else 5)
        print(f"staging: {json.dumps(results['staging'])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
