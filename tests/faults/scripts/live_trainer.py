"""The Trainer under `phalanx launch --live-recovery` with fault_tolerance="live"
(tests/faults/test_live_trainer.py).

The model records the sample indices of each micro-batch; a callback writes them to
this member's ledger when the step is applied (a dropped step's are forgotten at the
next step's start). KILL_MEMBER kills or stops itself (KILL_SIGNAL) in the forward of
KILL_STEP; or rank 1 of the world at each of KILL_STEPS, once each. After step
HOLD_STEP, rank 0 waits for a replacement to ask in (or the world to be HOLD_WORLD). Arguments:
OUTPUT_DIR MAX_STEPS [resume]. Prints the final parameters' digest and the final model's
loss on the whole dataset (SEED: the Trainer's seed, 3).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.runtime.live import current_live_group
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.callbacks import TrainerCallback
from phalanx.train.config.args import FaultTolerance, SyncMethod, ZeroStage

SAMPLES = 480
PAUSE_S = float(os.environ.get("PAUSE_S", "0.03"))
_SYNCS: dict[str, SyncMethod] = {"ddp": "ddp", "local_sgd": "local_sgd", "diloco": "diloco"}
SYNC = _SYNCS[os.environ.get("SYNC_METHOD", "ddp")]
SEED = int(os.environ.get("SEED", "3"))
STAGES: dict[str, ZeroStage] = {"0": 0, "1": 1, "2": 2, "3": 3}
HOLD_STEP = int(os.environ.get("HOLD_STEP", "-1"))
HOLD_WORLD = int(os.environ.get("HOLD_WORLD", "0"))
FORKED = b"phalanx.launch.warmserver" in Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
"""Whether a warm server forked this worker (--start-method forkserver), not the launcher."""
TOLERANCE: FaultTolerance = "restart" if os.environ.get("FAULT_TOLERANCE") == "restart" else "live"


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = int(os.environ.get("WIDTH", "32"))  # the benchmarks' bigger model
        hidden = [m for _ in range(int(os.environ.get("DEPTH", "0"))) for m in
                  (nn.Linear(width, width), nn.Tanh())]  # fmt: skip
        self.net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), *hidden, nn.Dropout(0.1),
                                 nn.Linear(width, 3))  # fmt: skip
        self.pending: list[int] = []
        self.trainer: Trainer | None = None

    def forward(self, batch: list[Tensor]) -> Tensor:
        x, y, index = batch
        self.pending += index.tolist()
        assert self.trainer is not None
        member = os.environ.get("PHALANX_LIVE_MEMBER") or f"r{os.environ['RANK']}"
        step = self.trainer.state.global_step
        if member == os.environ.get("KILL_MEMBER") and step == int(os.environ["KILL_STEP"]):
            die()
        if self.trainer.world.rank == 1 and str(step) in os.environ.get("KILL_STEPS", "").split(
            ","
        ):
            mark = Path(os.environ["LEDGER_DIR"]) / f"killed_{step}"
            if not mark.exists():  # once: a restarted run passes this step again
                mark.touch()
                die()
        return nn.functional.cross_entropy(self.net(x), y)


def die() -> None:
    """KILL_SIGNAL (SIGKILL) to this worker, its time written down first."""
    (Path(os.environ["LEDGER_DIR"]) / "killed_at").write_text(repr(time.time()))
    os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))


class Ledger(TrainerCallback):
    def __init__(self, model: Recorder, path: Path) -> None:
        self.model, self.path = model, path

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        die_in_setup(self.path.stem, "train")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.model.pending = []  # a dropped step's samples were never trained on

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.model.trainer
        assert trainer is not None
        group = current_live_group()
        entry = {"step": state.global_step, "world": trainer.world.world_size,
                 "epoch": trainer.state.epoch, "indices": self.model.pending,
                 "t": time.time(), "gen": -1 if group is None else group.generation,
                 "copy_bytes": copy_bytes(trainer),
                 "copy_bytes_in_memory": copy_bytes(trainer, in_files=False),
                 "forked": FORKED, "cpu_s": time.process_time(),
                 "threads": len(os.listdir("/proc/self/task"))}  # fmt: skip
        with self.path.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        time.sleep(PAUSE_S)
        if state.global_step == HOLD_STEP:
            hold_for_the_replacement(trainer)


def copy_bytes(trainer: Trainer, in_files: bool | None = None) -> int:
    """The bytes of ZeRO pieces this member holds in snapshots (its own and the parity it
    keeps for its neighbours; `in_files`: only those in files, or only those in memory)."""
    live = trainer.setup.live
    sharded = None if live is None else live.sharded
    return 0 if sharded is None else sharded.snapshots.nbytes(in_files)


def hold_for_the_replacement(trainer: Trainer) -> None:
    """On rank 0 after step HOLD_STEP: hold the run until a replacement has asked to join or
    the world is back at HOLD_WORLD, so that it surely joins before the end on a loaded
    machine; bounded by that event, not by a guess at how long a process takes to start."""
    group = current_live_group()
    if group is None or trainer.world.rank != 0:
        return
    while group.size() < HOLD_WORLD and not group.grow_requested():
        time.sleep(0.05)


def die_in_rebuild(member: str) -> None:
    """DIE_IN_REBUILD=<member>: that member dies inside its first rebuild after a loss (the
    survivors' DDP is being wrapped again), a second loss the recovery must absorb."""
    from phalanx.train import live

    rebuild = live.LiveTraining._rebuild

    def dying(self: live.LiveTraining, done: Any) -> None:
        if member == os.environ.get("DIE_IN_REBUILD") and done.reason != "joined as a replacement":
            os.kill(os.getpid(), signal.SIGKILL)
        rebuild(self, done)

    live.LiveTraining._rebuild = dying  # type: ignore[method-assign]


def slow_writes() -> None:
    """SLOW_WRITE_S=<s>: each background write waits that long before writing, so that a loss
    in the next steps finds it in flight."""
    seconds = float(os.environ.get("SLOW_WRITE_S", "0"))
    if not seconds:
        return
    from phalanx.train.checkpoint import writes

    write = writes.write

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return write(*args, **kwargs)

    writes.write = slow


def die_in_setup(member: str, where: str) -> None:
    """DIE_IN_SETUP=<member>:<where>: that member dies (SIGKILL) before the Trainer is built
    (`init`: before its group exists), once it is built (`built`), or as train() begins
    (`train`), before the first step; in the first attempt only."""
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first and os.environ.get("DIE_IN_SETUP") == f"{member}:{where}":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    resume = len(sys.argv) > 3
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=gen)
    labels = (x @ torch.randn(6, 3, generator=gen)).argmax(dim=1)  # learnable: a linear rule
    data = TensorDataset(x, labels, torch.arange(SAMPLES))
    model = Recorder()
    member = os.environ.get("PHALANX_LIVE_MEMBER") or f"r{os.environ['RANK']}"
    ledger = Path(os.environ["LEDGER_DIR"]) / f"{member}.jsonl"
    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=0.05, logging_steps=10, save_steps=int(os.environ.get("SAVE_STEPS", "0"))
        or max_steps, save_strategy="steps", disable_tqdm=True,
        overwrite_output_dir=not resume, ddp_backend="gloo", seed=SEED,
        sync_method=SYNC, sync_every=4, fault_tolerance=TOLERANCE,
        zero_stage=STAGES[os.environ.get("ZERO_STAGE", "0")],
        zero_offload="disk" if os.environ.get("ZERO_OFFLOAD") == "disk" else None,
        zero3_shard_size=int(os.environ.get("ZERO3_SHARD_SIZE") or 0) or None,
        replica_check_steps=int(os.environ.get("REPLICA_CHECK_STEPS", "0")),
        live_redundancy=int(os.environ.get("LIVE_REDUNDANCY", "2")),
    )  # fmt: skip
    die_in_rebuild(member)
    slow_writes()
    die_in_setup(member, "init")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[Ledger(model, ledger)])
    model.trainer = trainer
    die_in_setup(member, "built")
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    digest = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    model.eval()
    with torch.no_grad():  # the final model's loss on the whole dataset
        fit = float(nn.functional.cross_entropy(model.net(data.tensors[0]), data.tensors[1]))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the benchmarks'
    print(f"[{member}] done step={result.global_step} loss={result.train_loss:.6f} "
          f"digest={digest:.15e} eval={fit:.6f} peak_rss_mb={peak_mb:.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
