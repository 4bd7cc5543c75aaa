"""The Trainer's own checkpoint entries: its counters, the data position, the RNG streams.

Each is a small `Stateful` adapter (see stateful.py) over state the loop
keeps elsewhere, so the checkpointer treats them like the model.

Exact resume needs the data order (the sampler's epoch and position), every
rank's random generators (dropout), the optimizer, scheduler and scaler
states, and the micro-batch position to continue unchanged. That holds when
the checkpoint's data layout (world size, per-device batch size,
accumulation, seed, drop_last) is this run's. A different layout is allowed
with a warning: the model and optimizer state carry over (replicated, or
resharded by DCP under ZeRO), and the interrupted epoch restarts from the
checkpoint's global sample count, rounded down to a whole optimizer step
(see `SamplerPosition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from torch import nn
from torch.optim import Optimizer

from phalanx import zero3
from phalanx.data.sampler import DistributedSampler
from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.train.checkpoint.rng import capture_rng_state, restore_rng_state
from phalanx.train.checkpoint.stateful import Placement
from phalanx.train.config.args import TrainingArguments

# Arguments that change what a step computes; a resume that changes one says so.
COMPUTE_FIELDS: Final = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "dataloader_drop_last",
    "bf16",
    "fp16",
)
# Of those, the ones the saved optimizer and scheduler states override on load.
OPTIMIZER_FIELDS: Final = ("learning_rate", "weight_decay")


@dataclass(frozen=True)
class TrainOutput:
    """What `Trainer.train()` returns."""

    global_step: int
    train_loss: float
    """Mean step loss over the whole run, steps before a resume included (as Hugging
    Face's); NaN when no step was ever trained."""
    samples_per_second: float
    """Training samples over all ranks per second of this call's loop."""
    runtime_s: float
    resumed_from: str | None
    launcher: str = "none"
    """Who started the run: `World.launcher` ("env", "ray", "slurm", "mpi", "none")."""


class ResumeWarning(UserWarning):
    """A resume that is not an exact continuation: arguments or the world size changed."""


@dataclass
class TrainState:
    """Where the loop stands; saved only between optimizer steps."""

    global_step: int = 0
    epoch: int = 0
    batches_done: int = 0
    """Micro-batches of `epoch` already trained on, by every rank."""
    loss_sum: float = 0.0
    """Sum of the step losses (each the mean over the step's samples on every rank) of the
    steps trained so far, as of the last save or the end of train(); the mean of the run is
    loss_sum / (global_step - skipped_steps)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite gradient (on_nonfinite_grad="skip"); they count in
    global_step, as their data was used up."""
    skipped_in_a_row: int = 0
    """How many of the latest steps were skipped, one after the other."""
    best_metric: float | None = None
    """The best metric_for_best_model seen in an evaluation so far."""
    best_global_step: int | None = None
    """The step of that evaluation."""
    best_model_checkpoint: str | None = None
    """The checkpoint written at that step, if one was."""


class Counters:
    """Checkpoint entry "trainer": step, epoch, loss so far, world size and arguments."""

    checkpoint_placement: Placement = "replicated"

    def __init__(self, state: TrainState, args: TrainingArguments, world: World) -> None:
        self.state = state
        self.args = args
        self.world = world
        self.changes: list[str] = []
        """After a load: each computation-changing argument that differs, "name old → new"."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "loss_sum": self.state.loss_sum,
            "skipped_steps": self.state.skipped_steps,
            "skipped_in_a_row": self.state.skipped_in_a_row,
            "best_metric": self.state.best_metric,
            "best_global_step": self.state.best_global_step,
            "best_model_checkpoint": self.state.best_model_checkpoint,
            "world_size": self.world.world_size,
            "args": self.args.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.global_step = int(state_dict["global_step"])
        self.state.epoch = int(state_dict["epoch"])
        self.state.loss_sum = float(state_dict["loss_sum"])
        self.state.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.state.skipped_in_a_row = int(state_dict.get("skipped_in_a_row", 0))
        self.state.best_metric = state_dict.get("best_metric")
        self.state.best_global_step = state_dict.get("best_global_step")
        self.state.best_model_checkpoint = state_dict.get("best_model_checkpoint")
        saved_args = state_dict["args"]
        self.changes = [
            f"{name} {saved_args.get(name)!r} → {getattr(self.args, name)!r}"
            for name in COMPUTE_FIELDS
            if saved_args.get(name) != getattr(self.args, name)
        ]
        if state_dict["world_size"] != self.world.world_size:
            self.changes.append(f"world size {state_dict['world_size']} → {self.world.world_size}")

    def changed_optimizer_fields(self) -> list[str]:
        return [c for c in self.changes if c.split(" ", 1)[0] in OPTIMIZER_FIELDS]


class DataPosition(Protocol):
    """What the resume reads of a data entry: a sampler's (below) or a stream's (streams.py)."""

    approximate: str | None

    def consumed(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SamplerPosition:
    """Checkpoint entry "sampler": how far into its epoch the loop is, and the sampler's state.

    It saves the position the loop has *consumed* (micro-batches trained on
    times the batch size), not what the DataLoader prefetched. Loaded under
    the same data layout it continues at the exact next sample. Under another
    layout, the saved position would name other samples, so the epoch
    restarts approximately: the samples all ranks consumed (saved position x
    saved world size) divided among this run's ranks and batches, rounded
    down to a whole optimizer step. Nothing of the epoch is skipped; at most
    one step's samples are seen twice (a changed seed reorders the epoch, so
    its rest is drawn from the new order).
    """

    checkpoint_placement: Placement = "replicated"

    def __init__(
        self,
        sampler: DistributedSampler,
        state: TrainState,
        args: TrainingArguments,
        micro_batches_per_epoch: int,
    ) -> None:
        self.sampler = sampler
        self.state = state
        self.args = args
        self.micro_batches_per_epoch = micro_batches_per_epoch
        self.approximate: str | None = None
        """After a load under another layout: what the data position became, in words."""

    def _layout(self) -> dict[str, Any]:
        return {
            "world_size": self.sampler.num_replicas,
            "per_device_train_batch_size": self.args.per_device_train_batch_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "seed": self.args.seed,
            "dataloader_drop_last": self.args.dataloader_drop_last,
        }

    def consumed(self) -> int:
        """Samples this rank has trained on in the current epoch."""
        batch = self.args.per_device_train_batch_size
        return min(self.state.batches_done * batch, len(self.sampler))

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(consumed=self.consumed()),
            "batches_done": self.state.batches_done,
            "layout": self._layout(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["sampler"]
        length = self.sampler.state_dict()["dataset_len"]
        if saved["dataset_len"] != length:
            raise ConfigurationError(
                f"the checkpoint was written for a training set of {saved['dataset_len']} "
                f"samples but this one has {length} — resume with the same dataset"
            )
        self.approximate = None
        if state_dict["layout"] == self._layout():
            self.sampler.load_state_dict(saved)
            self.state.batches_done = int(state_dict["batches_done"])
            return
        self._restart_epoch(int(saved["epoch"]), int(saved["position"]) * saved["num_replicas"])

    def _restart_epoch(self, epoch: int, consumed_by_all: int) -> None:
        world = self.sampler.num_replicas
        batch = self.args.per_device_train_batch_size
        micro = min(consumed_by_all // world // batch, self.micro_batches_per_epoch)
        if micro < self.micro_batches_per_epoch:
            micro -= micro % self.args.gradient_accumulation_steps  # a whole step
        self.state.batches_done = micro
        self.sampler.set_epoch(epoch)
        self.sampler.load_state_dict(self.sampler.state_dict(consumed=self.consumed()))
        self.approximate = (
            f"epoch {epoch} continues at sample {self.consumed() * world} of "
            f"{self.sampler.total_size} (the checkpoint was at sample "
            f"{consumed_by_all}; rounded down to a whole step, so nothing is skipped)"
        )


class RngStreams:
    """Checkpoint entry "rng": each rank's Python, NumPy, torch and CUDA generators.

    Loading keeps the state aside; `restore()` applies it right before the
    loop continues, so nothing in between can shift the dropout masks. At
    another world size rank r takes saved rank r mod (saved world size): the
    generators continue, though not as an uninterrupted run's would.
    """

    checkpoint_placement: Placement = "per_rank"

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def restore(self) -> None:
        if self._pending is not None:
            restore_rng_state(self._pending)
            self._pending = None


def resume_warning(name: str, counters: Counters, position: DataPosition) -> str | None:
    """One line naming every changed argument (old → new) and what it means, or None."""
    if not counters.changes:
        return None
    parts = [f"resuming {name} with changed arguments: {', '.join(counters.changes)}"]
    kept = counters.changed_optimizer_fields()
    if kept:
        names = " and ".join(c.split(" ", 1)[0] for c in kept)
        parts.append(f"the saved optimizer and scheduler keep the checkpoint's {names}")
    if position.approximate is not None:
        parts.append(f"the data order is not the uninterrupted run's: {position.approximate}")
    else:
        parts.append("the data position carries over exactly")
    return parts[0] + " — " + "; ".join(parts[1:])


class ShardedModel:
    """Checkpoint entries "model" and "optimizer" under zero_stage=3: DTensor shards, written
    by every rank through torch.distributed.checkpoint (which reshards on load)."""

    checkpoint_placement: Placement = "sharded"

    def __init__(self, model: nn.Module, optimizer: Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        """None: this entry is the model's pieces; else this optimizer's state of them."""

    def save_sharded(self, directory: Path) -> None:
        if self.optimizer is None:
            zero3.save_model_sharded(self.model, directory)
        else:
            zero3.save_optimizer_sharded(self.model, self.optimizer, directory)

    def sharded_state_dict(self) -> dict[str, Any]:
        """What save_sharded writes (DTensor shards): a background save copies it."""
        if self.optimizer is None:
            return zero3.model_state_to_save(self.model)
        return zero3.optimizer_state_to_save(self.model, self.optimizer)

    def load_sharded(self, directory: Path) -> None:
        if self.optimizer is None:
            zero3.load_model_sharded(self.model, directory)
        else:
            zero3.load_optimizer_sharded(self.model, self.optimizer, directory)
