"""Disk offload against in-memory stage 3, interleaved in one run, on a model that fits both ways.

Two gloo ranks each build two Trainers at zero_stage=3 (AdamW, clipping at
1.0) over the same MLP from the same seed: `memory` (stage 3, state in host
memory) and `disk` (zero_offload="disk": shards, gradients and Adam's state in
files, the optimizer step streamed a window at a time). They take turns,
round by round, in a balanced order (interleave.py), each stepping the same
batches; a step is the Trainer's own (forward, backward, clip, AdamW), its time
the slower rank's. Reported:

- disk step / memory step (target <= 1.5), from the medians and per round;
- exposed I/O: how long the offloaded optimizer step waited for its I/O thread,
  and the major page faults the training thread took (a gather reading a shard
  not in memory), as a share of the disk step (target <= 20%);
- the I/O thread's achieved bandwidth against the disk's own, measured on the
  spot in the same offload directory by both ranks at once: a file the size of
  a rank's offloaded state written and fsync'd, then read cold (after
  posix_fadvise DONTNEED) and with O_DIRECT;
- the disk during the optimizer step (`storage_in_optimizer_step`): the bytes
  both ranks' steps read from and wrote to storage (/proc/self/io, O_DIRECT
  included, the kernel's cache not), and the share of the step that the disk's
  own rates need for them, measured with the step's own O_DIRECT requests (its
  pieces and lanes) by both ranks at once.

`--load N` runs it beside N busy background processes (load.py).

`--timeline PATH` records the disk variant's timeline (Chrome trace: the
offload reads and writes are spans on each rank's "io" track).

    python benchmarks/offload_speed.py                      # ~3 minutes on 2 cores
    python benchmarks/offload_speed.py --tiny --rounds 2    # seconds: checks it runs
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import interleave
import load
import spawn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload_speed.json"
MB = 2**20
VARIANTS = ("memory", "disk")


# ------------------------------------------------------------------------- the disk itself
def disk_bandwidth(directory: Path, nbytes: int, rank: int) -> dict[str, float]:
    """This rank's write+fsync, cold read and O_DIRECT read of an `nbytes` file (MB/s);
    the caller runs every rank at once, as the offloaded steps do."""
    import torch.distributed as dist

    path = directory / f"disk-probe-{rank}.bin"
    chunk = 8 * MB
    block = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(chunk))
    out: dict[str, float] = {}
    try:
        dist.barrier()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for offset in range(0, nbytes, chunk):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
        os.close(fd)
        out["write_fsync_mb_s"] = nbytes / MB / (time.perf_counter() - start)
        dist.barrier()
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written back above: now dropped
        dist.barrier()
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [block], offset)
        out["cold_read_mb_s"] = nbytes / MB / (time.perf_counter() - start)
        os.close(fd)
        dist.barrier()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [block], offset)
        out["direct_read_mb_s"] = nbytes / MB / (time.perf_counter() - start)
        os.close(fd)
        out.update(direct_with_lanes(directory))
    finally:
        path.unlink(missing_ok=True)
    return out


def direct_with_lanes(directory: Path) -> dict[str, float]:
    """The disk's own O_DIRECT rates for the offloaded step's requests (its pieces, its lanes
    in flight): the planner's probe of them, every rank at once after a barrier (MB/s)."""
    import torch.distributed as dist

    from phalanx.train.plan.probe import disk_direct_rates

    dist.barrier()
    rates = disk_direct_rates(str(directory))
    assert rates is not None, f"{directory} refuses O_DIRECT: the step maps its state there"
    return {"lanes_read_mb_s": rates[0] / MB, "lanes_write_mb_s": rates[1] / MB}


def storage_bytes() -> tuple[int, int]:
    """This process's bytes read from and written to the storage layer so far (/proc/self/io:
    O_DIRECT included, what the kernel's cache served not)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class StorageCounter:
    """The storage bytes a streamer's steps move: its step, wrapped, counts them."""

    def __init__(self, streamer: Any) -> None:
        self.read = self.written = 0
        step = streamer.step

        def counted(optimizer: Any) -> None:
            read, written = storage_bytes()
            try:
                step(optimizer)
            finally:
                now = storage_bytes()
                self.read += now[0] - read
                self.written += now[1] - written

        streamer.step = counted


# ------------------------------------------------------------------------------ the ranks
def variants(args: argparse.Namespace) -> list[str]:
    """memory, disk (at --window-mb), mapped (--mapped: disk with O_DIRECT off, the state
    stepped through its mappings), and disk-W for each of --extra-windows."""
    extra = [f"disk-{w}" for w in args.extra_windows.split(",") if w]
    return [*VARIANTS, *(["mapped"] if args.mapped else []), *extra]


def make_trainer(variant: str, args: argparse.Namespace, scratch: Path) -> Any:
    import torch
    from models import TanhMLP
    from torch import nn
    from torch.utils.data import TensorDataset

    import phalanx

    torch.manual_seed(0)
    model = TanhMLP(args.layers, args.width)
    data = TensorDataset(torch.zeros(8, args.width))  # unused: the loop feeds its own batches
    disk = variant.startswith("disk") or variant == "mapped"
    window = float(variant.split("-")[1]) if "-" in variant else args.window_mb
    targs = phalanx.TrainingArguments(
        output_dir=str(scratch / f"out-{variant}"),
        overwrite_output_dir=True,
        zero_stage=3,
        zero3_reshard_after_forward=not args.keep_gathered,
        max_steps=10**6,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        save_steps=10**9,
        report_to=[],
        disable_tqdm=True,
        zero_offload="disk" if disk else None,
        zero_offload_dir=str(scratch / "offload") if disk else None,
        zero_offload_window_mb=window,
        optim=args.memory_optim if not disk else "adamw_torch",  # offload fuses by itself
        timeline=args.timeline if variant == "disk" and args.timeline else None,
    )
    from phalanx.train.trainer_state import TrainState

    trainer = phalanx.Trainer(
        model=model,
        args=targs,
        train_dataset=data,
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )
    trainer.setup.state = TrainState()
    if variant == "mapped":  # before the first step: no state is in files yet
        from phalanx.offload import streamer_of

        streamer = streamer_of(trainer.optimizer)
        assert streamer is not None
        streamer.files.direct = False
    time_optimizer(trainer)
    return trainer


def time_optimizer(trainer: Any) -> None:
    """`trainer._opt_s`: the wall time of its optimizer's steps (hooks around each)."""
    opt = trainer.optimizer
    marks: list[float] = []
    trainer._opt_s = 0.0
    opt.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))

    def post(*_: Any) -> None:
        trainer._opt_s += time.perf_counter() - marks.pop()

    opt.register_step_post_hook(post)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from phalanx.offload import streamer_of

    scratch = Path(args.scratch)
    names = variants(args)
    trainers = {v: make_trainer(v, args, scratch) for v in names}
    streamers = {v: streamer_of(t.optimizer) for v, t in trainers.items() if v != "memory"}
    streamer = streamers["disk"]
    assert streamer is not None, "the disk Trainer's optimizer does not stream"
    counters = {v: StorageCounter(s) for v, s in streamers.items()}
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [
        [torch.randn(args.batch, args.width, generator=gen) for _ in range(2)]
        for _ in range(args.per_round)
    ]
    for trainer in trainers.values():  # untimed: the first step makes Adam's state
        for batch in batches[: args.warmup]:
            trainer.setup.stepper.run([batch], 1, trainer.loss_fn, trainer.state)
    steps: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    rounds = interleave.balanced_rounds(args.rounds, args.rounds * args.per_round, len(names))
    for r in range(rounds):
        for name in interleave.balanced_order(r, names):
            trainer = trainers[name]
            dist.barrier()
            for batch in batches:
                step = timed_step(trainer, batch, streamers.get(name), counters.get(name))
                steps[name].append(step)
    state_bytes = sum(files_bytes(streamer))
    disk = disk_bandwidth(scratch / "offload", state_bytes, rank)
    out = {
        "rank": rank,
        "steps": steps,
        "state_bytes": state_bytes,
        "disk": disk,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_equal": params_equal(trainers),
    }
    timeline = trainers["disk"].timeline
    if timeline is not None:  # spawned ranks end with os._exit: no exit hook writes it
        from phalanx.diagnostics.trace import merge

        timeline.write()
        dist.barrier()
        if rank == 0:
            trace = merge(timeline.path, world)
            out["trace_io_spans"] = sum(1 for e in trace["traceEvents"] if e.get("tid") == 2)
    for trainer in trainers.values():
        trainer.close()
    return out


def files_bytes(streamer: Any) -> list[int]:
    return [streamer.files.nbytes]


def timed_step(
    trainer: Any, batch: list[Any], streamer: Any, counter: StorageCounter | None
) -> dict[str, float]:
    """One Trainer step; its wall time (the slower rank's) and, offloaded, its I/O (the
    streamer's own figures, and the storage bytes its step moved)."""
    import torch
    import torch.distributed as dist

    before = None if streamer is None else dict(vars(streamer.stats))
    storage = None if counter is None else (counter.read, counter.written)
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    process = resource.getrusage(resource.RUSAGE_SELF)
    trainer._opt_s = 0.0
    start = time.perf_counter()
    trainer.setup.stepper.run([batch], 1, trainer.loss_fn, trainer.state)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_THREAD)
    process_after = resource.getrusage(resource.RUSAGE_SELF)
    slowest = torch.tensor([wall])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step = {
        "s": float(slowest.item()),
        "own_s": wall,
        "optimizer_s": trainer._opt_s,
        "major_faults": float(after.ru_majflt - usage.ru_majflt),
        "minor_faults": float(after.ru_minflt - usage.ru_minflt),
        "thread_cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime,
        "thread_sys_s": after.ru_stime - usage.ru_stime,
        "process_cpu_s": process_after.ru_utime
        + process_after.ru_stime
        - process.ru_utime
        - process.ru_stime,
    }
    if streamer is not None and before is not None:
        step.update({k: v - before[k] for k, v in vars(streamer.stats).items()})
    if counter is not None and storage is not None:
        step["storage_read_bytes"] = counter.read - storage[0]
        step["storage_written_bytes"] = counter.written - storage[1]
    return step


def params_equal(trainers: dict[str, Any]) -> float:
    """Largest difference between the memory Trainer's shards and any other's: they saw the
    same batches."""
    mem = list(trainers["memory"].model.parameters())
    return max(
        float((a._local_tensor - b._local_tensor).abs().max())
        for name, trainer in trainers.items()
        if name != "memory"
        for a, b in zip(mem, trainer.model.parameters())
    )


# ------------------------------------------------------------------------------ the report
def rate(steps: list[dict[str, float]], what: str, seconds: Any) -> float | None:
    """MB/s of `what` over the steps' `seconds(step)`; None where that was not timed."""
    total = sum(seconds(s) for s in steps)
    return sum(s[what] for s in steps) / MB / total if total > 0 else None


def storage_share(ranks: list[dict[str, Any]], disk_own: dict[str, float]) -> dict[str, float]:
    """The disk during the offloaded optimizer steps: the storage bytes both ranks moved, per
    second of step, and the share of the step the disk's own rates (the step's requests,
    both ranks at once: `direct_with_lanes`) need for those bytes, reads then writes."""
    steps = [r["steps"]["disk"] for r in ranks]
    read = sum(s["storage_read_bytes"] for d in steps for s in d)
    written = sum(s["storage_written_bytes"] for d in steps for s in d)
    step_s = statistics.mean(sum(s["step_s"] for s in d) for d in steps)
    needed = read / MB / disk_own["lanes_read_mb_s"] + written / MB / disk_own["lanes_write_mb_s"]
    return {
        "read_mb_per_step": read / len(steps[0]) / MB,
        "written_mb_per_step": written / len(steps[0]) / MB,
        "mb_s": (read + written) / MB / step_s,
        "disk_own_read_mb_s": disk_own["lanes_read_mb_s"],
        "disk_own_write_mb_s": disk_own["lanes_write_mb_s"],
        "share_of_disk": needed / step_s,
    }


def summarise(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    mem = [s["s"] for s in ranks[0]["steps"]["memory"]]
    disk = [s["s"] for s in ranks[0]["steps"]["disk"]]
    per_round = [
        statistics.median(disk[i : i + args.per_round])
        / statistics.median(mem[i : i + args.per_round])
        for i in range(0, len(mem), args.per_round)
    ]
    disk_med = statistics.median(disk)
    phases = {
        v: {
            k: statistics.median(s[k] for s in ranks[0]["steps"][v])
            for k in (
                "optimizer_s",
                "minor_faults",
                "major_faults",
                "thread_cpu_s",
                "thread_sys_s",
                "process_cpu_s",
            )
        }
        for v in variants(args)
    }
    io = {}
    for r in ranks:
        d = r["steps"]["disk"]
        moved = sum(s["read_bytes"] + s["written_bytes"] for s in d)
        io[r["rank"]] = {
            "wait_share": sum(s["wait_s"] for s in d) / sum(s["s"] for s in d),
            "optimizer_share": sum(s["step_s"] for s in d) / sum(s["s"] for s in d),
            "major_faults_per_step": statistics.median(s["major_faults"] for s in d),
            "io_busy_share": sum(s["io_s"] for s in d) / sum(s["s"] for s in d),
            "read_mb_s": rate(d, "read_bytes", lambda s: s.get("read_s", 0.0)),
            "write_mb_s": rate(d, "written_bytes", lambda s: s["io_s"] - s.get("read_s", 0.0)),
            "moved_mb_per_step": moved / len(d) / MB,
            "moved_mb_s_in_optimizer_step": moved / MB / sum(s["step_s"] for s in d),
            "achieved_mb_s": moved / MB / sum(s["io_s"] for s in d),
        }
    disk_own = {
        k: sum(r["disk"][k] for r in ranks) for k in ranks[0]["disk"]
    }  # both ranks at once: the sum is what the disk gave the two
    achieved = sum(v["achieved_mb_s"] for v in io.values())
    # What the disk's own rates allow for this step's mix of reads and writes.
    steps = ranks[0]["steps"]["disk"]
    read, written = (sum(s[k] for s in steps) for k in ("read_bytes", "written_bytes"))
    mix = (read + written) / (
        read / disk_own["cold_read_mb_s"] + written / disk_own["write_fsync_mb_s"]
    )
    storage = storage_share(ranks, disk_own)
    extras = {
        v: {
            "step_ms": statistics.median(s["s"] for s in ranks[0]["steps"][v]) * 1e3,
            "over_memory": statistics.median(s["s"] for s in ranks[0]["steps"][v])
            / statistics.median(mem),
            "wait_share": [
                sum(s["wait_s"] for s in r["steps"][v]) / sum(s["s"] for s in r["steps"][v])
                for r in ranks
            ],
            "moved_mb_s_in_optimizer_step": [
                sum(s["read_bytes"] + s["written_bytes"] for s in r["steps"][v])
                / MB
                / sum(s["step_s"] for s in r["steps"][v])
                for r in ranks
            ],
        }
        for v in variants(args)[len(VARIANTS) :]
    }
    return {
        "other_windows": extras,
        "memory_ms": statistics.median(mem) * 1e3,
        "disk_ms": disk_med * 1e3,
        "disk_over_memory": disk_med / statistics.median(mem),
        "disk_over_memory_per_round": per_round,
        "disk_over_memory_paired_median": statistics.median(per_round),
        "rank0_phase_medians": phases,
        "io": io,
        "disk_own_mb_s_both_ranks": disk_own,
        "achieved_mb_s_both_ranks": achieved,
        "disk_own_for_this_mix_mb_s": mix,
        "achieved_over_disk_own": achieved / mix,
        "storage_in_optimizer_step": storage,
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "max_abs_param_diff": max(r["params_equal"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--window-mb", type=float, default=64.0)
    parser.add_argument(
        "--extra-windows", default="", help="more disk variants at these windows (MB): 16,256"
    )
    parser.add_argument(
        "--mapped", action="store_true", help="add disk offload with O_DIRECT off (mappings)"
    )
    parser.add_argument(
        "--memory-optim",
        default="adamw_torch_fused",
        help="the in-memory Trainer's optim (the offloaded step runs fused AdamW itself)",
    )
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="both Trainers with zero3_reshard_after_forward=False (one gather a step)",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--load", type=int, default=0, help="busy background processes while it runs (load.py)"
    )
    parser.add_argument("--scratch", default="/tmp/phalanx-offload-speed")
    parser.add_argument("--timeline", default=None, help="write the disk variant's trace here")
    parser.add_argument("--tiny", action="store_true", help="a small model: checks it runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.width, args.batch = 2, 64, 4
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    started = load.moment()
    with load.busy(args.load):
        ranks = spawn.run_ranks(rank_main, 2, args, threads=args.threads)
    params = args.layers * (args.width * args.width + args.width)
    report: dict[str, Any] = {
        "config": {**vars(args), "out": str(args.out), "params": params},
        # the ranks inherit GLIBC_TUNABLES: `glibc.malloc.hugetlb=1` as phalanx launch sets it
        "machine": load.machine(
            started,
            glibc_tunables=os.environ.get("GLIBC_TUNABLES"),
            background=load.describe(args.load),
        ),
        "summary": summarise(ranks, args),
        "ranks": ranks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"config": report["config"], "summary": report["summary"]}, indent=1))
    sys.exit(0 if report["summary"]["max_abs_param_diff"] <= 1e-5 else 1)


if __name__ == "__main__":
    main()
