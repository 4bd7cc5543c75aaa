"""A model that does not fit, trained: stage 3 under a per-rank memory cap, with and without
disk offload, against the same run uncapped.

Each rank runs in its own memory cgroup (cgroup v1 or v2; needs root) capped at
`--cap-mb`. The model is an MLP of `--layers` square Linears of width
`--width`, built a layer at a time and sharded as it is built (FSDP2's way for
a model larger than one rank's memory: no rank ever holds it whole). Three
runs, 2 ranks each, the Trainer at zero_stage=3, AdamW, clipping:

- `capped`: no offload, under the cap: the kernel kills it;
- `offload`: zero_offload="disk", under the cap: it trains;
- `reference`: no offload, no cap: the loss curve the offloaded run must match.

Reports each run's exit, its losses, its per-rank peak (the cgroup's own
peak, page cache included, and RSS), its step time, and the ratio of the
whole training state (parameters, gradients, Adam: 16 bytes a parameter) to
the per-rank cap.

`--route api` trains with docs/zero.md's calls instead of the Trainer
(`fully_shard(..., offload_policy=policy)`, `offload_optimizer(AdamW(...),
policy)`, torch's `clip_grad_norm_`, the script's own loop), nothing else:
what a user who never heard of runtime/hostmem.py gets. `--modes` picks runs.

    sudo python benchmarks/offload_cgroup.py                      # 8x: ~5 minutes on 2 cores
    sudo python benchmarks/offload_cgroup.py --layers 6 --cap-mb 500   # a quick look
    sudo python benchmarks/offload_cgroup.py --route api --modes offload --out /tmp/api.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload_cgroup.json"


# ------------------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import phalanx
    from phalanx.offload import DiskOffloadPolicy

    torch.set_num_threads(1)
    phalanx.init(backend="gloo")
    offload = args.mode == "offload"
    policy = DiskOffloadPolicy(path=args.scratch) if offload else None
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):  # built and sharded one at a time: never whole on a rank
        layer = nn.Linear(args.width, args.width)
        phalanx.fully_shard(layer, offload_policy=policy)
        layers += [layer, nn.Tanh()]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*layers[:-1])

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            return self.body(batch[0])

    model = Net()
    phalanx.fully_shard(model, offload_policy=policy)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(64, args.width, generator=gen), torch.randn(64, args.width, generator=gen)
    )
    if args.route == "api":
        api_loop(args, model, policy, data)
        return
    targs = phalanx.TrainingArguments(
        output_dir=str(Path(args.scratch).parent / f"out-{args.mode}"),
        overwrite_output_dir=True,
        zero_stage=3,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=10**9,
        report_to=[],
        disable_tqdm=True,
        zero_offload="disk" if offload else None,
        zero_offload_dir=args.scratch if offload else None,
    )
    times: list[float] = []
    trainer = phalanx.Trainer(
        model=model,
        args=targs,
        train_dataset=data,
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )
    step = trainer.loop._train_step

    def timed_step(*a: object, **k: object) -> None:
        start = time.perf_counter()
        step(*a, **k)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)

    trainer.loop._train_step = timed_step  # type: ignore[method-assign]
    trainer.train()
    from phalanx.offload import streamer_of

    streamer = streamer_of(trainer.optimizer)
    stats = streamer.stats if streamer is not None else None
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": int(os.environ["RANK"]),
                "step_times_s": times,
                "loss_sums": [trainer.state.loss_sum],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "io": None
                if stats is None
                else {
                    "read_mb": stats.read_bytes / 2**20,
                    "written_mb": stats.written_bytes / 2**20,
                    "io_s": stats.io_s,
                    "wait_s": stats.wait_s,
                    "step_s": stats.step_s,
                },
            }
        ),
        flush=True,
    )
    trainer.close()


def api_loop(args: argparse.Namespace, model: Any, policy: Any, data: Any) -> None:
    """docs/zero.md's route with the script's own loop: the same batches and steps as the
    Trainer's run, the optimizer streamed only where the policy offloads."""
    import torch
    from torch import nn

    import phalanx

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if policy is not None:
        opt = phalanx.offload_optimizer(opt, policy)
    times, loss_sum = [], 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        first = (step * world + rank) * 4  # 4 samples per rank and step, as the Trainer's
        x, y = data[first : first + 4]
        loss = nn.functional.mse_loss(model([x]), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss_sum += loss.item()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rank": rank, "step_times_s": times, "loss_sums": [loss_sum], "peak_rss_mb": peak}
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------ cgroups
def make_cgroup(name: str, cap_bytes: int | None) -> Path:
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    base = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
    group = base / name
    group.mkdir(exist_ok=True)
    limit = "max" if cap_bytes is None else str(cap_bytes)
    if v2:
        (group / "memory.max").write_text(limit)
        (group / "memory.swap.max").write_text("0")
    else:
        (group / "memory.limit_in_bytes").write_text("-1" if cap_bytes is None else limit)
        with contextlib.suppress(OSError):
            (group / "memory.max_usage_in_bytes").write_text("0")  # reset the peak
    return group


def _join(group: Path) -> None:
    """A child's preexec_fn: it moves into its cgroup before exec, so every byte counts."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


def cgroup_peak(group: Path) -> float:
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if (group / name).exists():
            return int((group / name).read_text()) / 2**20
    return float("nan")


def run(args: argparse.Namespace, mode: str, cap: int | None, scratch: Path) -> dict[str, object]:
    port = 29000 + (os.getpid() % 1000)
    procs, groups = [], []
    for rank in range(2):
        group = make_cgroup(f"phalanx-offload-r{rank}", cap)
        groups.append(group)
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT / "src"),
        }
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--scratch", str(scratch)]
        cmd += ["--route", args.route]
        cmd += [
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--steps",
            str(args.steps),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=functools.partial(_join, group),
            )
        )
    start = time.monotonic()
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    results = []
    for rank, (p, out, group) in enumerate(zip(procs, outputs, groups)):
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        results.append(
            {
                "rank": rank,
                "exit": p.returncode,
                "killed_by_kernel": p.returncode in (-9, 137),
                "cgroup_peak_mb": cgroup_peak(group),
                "result": json.loads(line[7:]) if line else None,
                "tail": out.splitlines()[-3:] if not line else [],
            }
        )
    return {
        "mode": mode,
        "cap_mb": None if cap is None else cap / 2**20,
        "wall_s": time.monotonic() - start,
        "ranks": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="offload")
    parser.add_argument("--scratch", default="/tmp/phalanx-offload-bench/scratch")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cap-mb", type=int, default=600)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--route", choices=("trainer", "api"), default="trainer")
    parser.add_argument("--modes", default="capped,offload,reference")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    params = args.layers * (args.width * args.width + args.width)
    cap = args.cap_mb * 2**20
    report = {
        "parameters": params,
        "training_state_mb": 16 * params / 2**20,
        "cap_mb_per_rank": args.cap_mb,
        "state_over_cap": 16 * params / cap,
        "route": args.route,
        "runs": [
            run(args, mode, None if mode == "reference" else cap, scratch)
            for mode in args.modes.split(",")
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
