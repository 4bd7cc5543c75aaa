"""phalanx's offload against DeepSpeed's at the same tier: CPU against CPU, disk against NVMe.

The model of offload_speed.py (an MLP of `--layers` Linears `--width` square,
Tanh between, `--batch` samples a rank), world 2 on gloo, AdamW at lr 1e-4 with
no weight decay, gradients clipped at 1.0 (DeepSpeed's `gradient_clipping`,
phalanx's `max_grad_norm`), on the same batches. Per tier (`--tiers`):

- `cpu`: phalanx's Trainer at zero_stage=3, zero_offload="cpu" (the shards in
  host memory: FSDP2's CPUOffloadPolicy), against DeepSpeed ZeRO-3 with
  `offload_param` and `offload_optimizer` on `cpu` (ZeRO-Offload);
- `disk`: zero_offload="disk" (the shards, their gradients and Adam's state in
  files, the optimizer step streamed) against DeepSpeed ZeRO-3 with
  `offload_param` and `offload_optimizer` on `nvme` (ZeRO-Infinity), in the
  same directory's filesystem; and `phalanx-state`, Adam's state alone in files
  (zero_offload_fraction=0.5), which is what that DeepSpeed setting puts on NVMe
  for a model this size (its parameters stay in host memory: see PAIRS).

A `-kept` variant sets zero3_reshard_after_forward=False: DeepSpeed's stage-3
defaults (`stage3_max_reuse_distance` and `stage3_max_live_parameters`, 1e9)
keep every gathered parameter from forward to backward on a model under 1e9
parameters, where phalanx's default, FSDP2's, frees each unit after its forward
and gathers it again: the `-kept` variants hold what DeepSpeed holds.

DeepSpeed runs with its own recommended settings: the optimizer named in its
config, so that offloading it gives DeepSpeedCPUAdam (a fused, vectorised
kernel; phalanx gets torch's fused AdamW, `optim="adamw_torch_fused"`), and
the `aio` and buffer settings of its ZeRO-Infinity tutorial (and once more
with `max_in_cpu` at 0: see PAIRS). On a CPU-only machine
(DS_ACCELERATOR=cpu) "cpu" offload moves nothing off a device, for either
library: that tier compares the two ZeRO-3 engines as they run there.

`--huge-pages` starts every variant's processes, both libraries', with glibc's
malloc asking for transparent huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`),
as `phalanx launch` starts its workers; without it neither has them.

Each run is a fresh pair of processes (peak RSS is a process's), and the runs
alternate (`--rounds` of every variant, in a balanced order): median step (the
slower rank's), peak RSS per rank, the losses. It needs deepspeed, which the
project's venv does not hold: it says so and exits 0 without it.

    python3 -m venv /tmp/ds && /tmp/ds/bin/pip install torch==2.13.0 deepspeed
    /tmp/ds/bin/pip install --no-build-isolation deepspeed   # keeps that torch
    apt-get install -y libaio-dev                             # DeepSpeed's async_io op
    DS_ACCELERATOR=cpu /tmp/ds/bin/python benchmarks/ds_offload.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import interleave
import load
from models import TanhMLP

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ds_offload.json"
PAIRS = {
    "cpu": (("phalanx-cpu", "phalanx-cpu-kept"), ("deepspeed-cpu",)),
    "disk": (("phalanx-disk", "phalanx-disk-kept", "phalanx-state-kept"), ("deepspeed-nvme",)),
    "disk-all": (("phalanx-disk", "phalanx-disk-kept"), ("deepspeed-nvme-all",)),
}
"""Per tier: phalanx's variants, then DeepSpeed's at the same tier. `deepspeed-nvme` is the
ZeRO-Infinity tutorial's setting, which keeps up to 1e9 parameter elements in host memory
(`max_in_cpu`): a model this size never has its parameters on NVMe. `disk-all` (not run
by default) sets `max_in_cpu` to 0, so that they are, as phalanx's shards are in files:
DeepSpeed 0.19.8 on its CPU accelerator then fails in its first forward ("self and mat2
must have the same dtype, but got Float and BFloat16", zero/linear.py) wherever a
parameter is large enough to be partitioned (a 2048x2048 Linear; not a 256x256 one)."""


def _batches(args: argparse.Namespace, rank: int) -> list[list[Any]]:
    import torch

    gen = torch.Generator().manual_seed(1 + rank)
    return [
        [torch.randn(args.batch, args.width, generator=gen) for _ in range(2)]
        for _ in range(args.steps)
    ]


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_phalanx(args: argparse.Namespace, rank: int) -> tuple[list[float], list[float]]:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import phalanx
    from phalanx.train.trainer_state import TrainState

    tier = args.variant.split("-")[1]  # cpu, disk, or state: Adam's state alone in files
    torch.manual_seed(0)
    model = TanhMLP(args.layers, args.width)
    targs = phalanx.TrainingArguments(
        output_dir=str(Path(args.scratch) / "out-phalanx"),
        overwrite_output_dir=True,
        zero_stage=3,
        zero3_reshard_after_forward=not args.variant.endswith("-kept"),
        max_steps=10**6,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # torch's fused CPU kernel, as DeepSpeed steps its own
        save_steps=10**9,
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
        zero_offload="cpu" if tier == "cpu" else "disk",
        zero_offload_fraction=0.5 if tier == "state" else 1.0,  # Adam's state: half the bytes
        zero_offload_dir=None if tier == "cpu" else str(Path(args.scratch) / "offload-phalanx"),
    )
    trainer = phalanx.Trainer(
        model=model,
        args=targs,
        train_dataset=TensorDataset(torch.zeros(8, args.width)),
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )
    trainer.setup.state = TrainState()
    times, losses = [], []
    for batch in _batches(args, rank):
        start = time.perf_counter()
        result = trainer.setup.stepper.run([batch], 1, trainer.loss_fn, trainer.state)
        times.append(_slowest(time.perf_counter() - start))
        losses.append(float(result.loss))
    trainer.close()
    return times, losses


def run_deepspeed(args: argparse.Namespace, rank: int) -> tuple[list[float], list[float]]:
    import deepspeed
    import torch
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TanhMLP(args.layers, args.width)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(args, rank)
    )
    times, losses = [], []
    for x, y in _batches(args, rank):
        start = time.perf_counter()
        loss = nn.functional.mse_loss(engine([x, y]), y)
        engine.backward(loss)
        engine.step()
        times.append(_slowest(time.perf_counter() - start))
        losses.append(float(loss))
    return times, losses


def _ds_config(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer offloaded at the variant's tier, as DeepSpeed's
    ZeRO-Infinity tutorial sets it (its `aio` block and queue, five parameter buffers of
    1e8 elements), the optimizer named in the config (offloaded: DeepSpeedCPUAdam)."""
    if args.variant == "deepspeed-cpu":
        param: dict[str, Any] = {"device": "cpu", "pin_memory": False}
        optimizer: dict[str, Any] = {"device": "cpu", "pin_memory": False}
    else:
        nvme = Path(args.scratch) / f"offload-deepspeed-{rank}"
        nvme.mkdir(parents=True, exist_ok=True)
        param = {
            "device": "nvme",
            "nvme_path": str(nvme),
            "pin_memory": False,
            "buffer_count": 5,
            "buffer_size": 100_000_000,
            "max_in_cpu": 0 if args.variant == "deepspeed-nvme-all" else 1_000_000_000,
        }
        optimizer = {
            "device": "nvme",
            "nvme_path": str(nvme),
            "pin_memory": False,
            "buffer_count": 4,
            "fast_init": False,
        }
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": param,
            "offload_optimizer": optimizer,
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.variant.startswith("phalanx"):
        dist.init_process_group("gloo")
        times, losses = run_phalanx(args, rank)
    else:
        times, losses = run_deepspeed(args, rank)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"rank": rank, "times": times, "losses": losses, "rss": peak}))


def launch(args: argparse.Namespace, variant: str, port: int) -> dict[str, Any]:
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT / "src"),
        }
        if args.huge_pages:
            from phalanx.launch.workerenv import HUGE_PAGES  # what phalanx launch sets

            env["GLIBC_TUNABLES"] = HUGE_PAGES
        else:
            env.pop("GLIBC_TUNABLES", None)
        cmd = [sys.executable, __file__, "--worker", "--variant", variant]
        cmd += ["--layers", str(args.layers), "--width", str(args.width)]
        cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--scratch", args.scratch]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    ranks = []
    for p, out in zip(procs, outs):
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{variant} failed (exit {p.returncode}):\n" + out[-4000:])
        # kept with its exit: DeepSpeed's processes at times abort after their last step
        # ("terminate called without an active exception", exit -6)
        ranks.append({**json.loads(line[7:]), "exit": p.returncode})
    return {"variant": variant, "ranks": ranks}


def run_arguments(parser: argparse.ArgumentParser, batch: int, scratch: str) -> None:
    """The flags `launch` reads: the model, the batch, the steps, where runs write."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--steps", type=int, default=6, help="per run; the first is untimed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scratch", default=scratch)
    parser.add_argument("--timeout", type=float, default=1200)


def variant_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs: the median step (rank 0's record of the slower rank's time, the
    first step of each run left out), peak RSS per rank and at most, rank 0's losses."""
    steps = [t for run in runs for t in run["ranks"][0]["times"][1:]]
    return {
        "median_step_s": statistics.median(steps),
        "peak_rss_mb_per_rank": [[r["rss"] for r in run["ranks"]] for run in runs],
        "peak_rss_mb_max": max(r["rss"] for run in runs for r in run["ranks"]),
        "losses_rank0": runs[0]["ranks"][0]["losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="phalanx-disk")
    parser.add_argument("--tiers", default="cpu,disk", help="comma-separated: cpu, disk")
    run_arguments(parser, batch=256, scratch="/tmp/phalanx-ds-offload")
    parser.add_argument("--huge-pages", action="store_true", help="both: glibc.malloc.hugetlb=1")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed is not installed here: nothing to compare (see the docstring)")
        return
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    tiers = [t for t in args.tiers.split(",") if t]
    variants = tuple(dict.fromkeys(v for t in tiers for side in PAIRS[t] for v in side))
    runs: list[dict[str, Any]] = []
    started = load.moment()
    for r in range(interleave.balanced_rounds(args.rounds, args.rounds, len(variants))):
        for variant in interleave.balanced_order(r, variants):
            runs.append(launch(args, variant, 29500 + len(runs)))
            print(variant, "done", flush=True)
    summary: dict[str, Any] = {
        variant: variant_summary([run for run in runs if run["variant"] == variant])
        for variant in variants
    }
    for tier in tiers:
        for phalanx_variant, peer in ((m, n) for m in PAIRS[tier][0] for n in PAIRS[tier][1]):
            ours, theirs = summary[phalanx_variant], summary[peer]
            summary[f"{phalanx_variant}_over_{peer}"] = {
                "step": ours["median_step_s"] / theirs["median_step_s"],
                "peak_rss": ours["peak_rss_mb_max"] / theirs["peak_rss_mb_max"],
                "largest_loss_difference": max(
                    abs(a - b) for a, b in zip(ours["losses_rank0"], theirs["losses_rank0"])
                ),
            }
    report = {
        "config": {**vars(args), "out": str(args.out)},
        "machine": load.machine(started),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
