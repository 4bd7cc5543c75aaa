"""`Trainer`: the data-parallel training loop, so you do not write it by hand.

It joins the job through `phalanx.init` (under any launcher, or as plain
`python train.py`: then a one-rank group, destroyed again on `close()`), wraps
the model in phalanx's DistributedDataParallel when there is more than one
rank, and shards the data with phalanx's DistributedSampler. A step is
`gradient_accumulation_steps` micro-batches, all but the last under
`no_sync()`, so gradients are all-reduced once per step; then clip,
optimizer step, scheduler step. Logging, evaluation and checkpoints happen
between steps, on every rank together.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset

from phalanx import zero3
from phalanx.data.sampler import DistributedSampler
from phalanx.ddp.module import DistributedDataParallel
from phalanx.diagnostics import progress
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.replicas import check_replicas
from phalanx.errors import ConfigurationError
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.train.args import TrainingArguments
from phalanx.train.batches import LossFn, step_groups
from phalanx.train.checkpoint import PREFIX
from phalanx.train.checkpointer import Checkpointer
from phalanx.train.comm import PerRank, attach_comm_hook, make_periodic_sync
from phalanx.train.evaluation import ComputeMetrics, EvalSetup, evaluate_model
from phalanx.train.nonfinite import NonFiniteGuard, check_parameters
from phalanx.train.outputdir import prepare_output_dir, restart_note
from phalanx.train.report import RunReport, human_size
from phalanx.train.rng import seed_everything
from phalanx.train.runlog import CommMeter, RunLog, emit
from phalanx.train.schedules import make_scheduler
from phalanx.train.setup import (
    build_optimizer,
    check_same_arguments,
    check_user_optimizer,
    join_world,
    prepare_model,
    record_offload_to,
    release,
    train_loader,
    wrap_model,
)
from phalanx.train.stateful import Entry
from phalanx.train.step import StepRunner, autocast_for
from phalanx.train.stopping import Stop, StopRequests, TrainingStopped
from phalanx.train.trainer_state import (
    Counters,
    ResumeWarning,
    RngStreams,
    SamplerPosition,
    ShardedModel,
    TrainState,
    resume_warning,
)
from phalanx.train.uneven import uneven_inputs


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


class Trainer:
    """Train `model` on `train_dataset` as `args` says; see docs/trainer.md."""

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments | None = None,
        train_dataset: Dataset[Any] | None = None,
        eval_dataset: Dataset[Any] | None = None,
        loss_fn: LossFn | None = None,
        optimizer: Optimizer | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        compute_metrics: ComputeMetrics | None = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.loss_fn = loss_fn
        self.collate_fn = collate_fn
        self.compute_metrics = compute_metrics
        self.state = TrainState()
        self._runlog: RunLog | None = None
        """The log window and totals of the train() call under way (phalanx.train.runlog)."""
        self._loss_before = 0.0
        self._stopped_by: Stop | None = None
        """The signal the ranks agreed to stop for (train() then saves and exits)."""
        self._saved_step: int | None = None
        """The step output_dir holds a checkpoint of, written or resumed by this Trainer."""
        self.sampler: DistributedSampler | None = None
        self.world, self._owns_group = join_world(self.args)
        """Rank, world size, device, and the group: one of one rank for a plain process."""
        self._report = RunReport(self.world, self.args)
        path = self.args.timeline or os.environ.get(timelines.ENV)
        self.timeline = (
            timelines.start(path, self.world.rank, self.world.world_size) if path else None
        )
        """The process's timeline (phalanx.diagnostics.timeline), or None when off."""
        self._closed = False
        try:
            check_same_arguments(self.args, self.world)  # before any collective of the run
            self._setup_model(model, optimizer)
            if train_dataset is not None:
                self._setup_training(train_dataset)
        except BaseException:
            self.close()  # a Trainer that could not be made must not keep its group
            raise

    # ------------------------------------------------------------------ setup
    def _setup_model(self, model: nn.Module, optimizer: Optimizer | None) -> None:
        self.model: nn.Module = prepare_model(model, self.args, self.world.device)
        """The unwrapped module: what you save, export, or evaluate yourself."""
        self.wrapped_model: nn.Module = wrap_model(self.model, self.args, self.world)
        """What the loop calls: phalanx DDP with more than one rank, else the model itself."""
        if isinstance(self.wrapped_model, DistributedDataParallel):
            self.wrapped_model.timeline = self.timeline
        for unit in zero3.units(self.wrapped_model):  # stage 3: its gathers and reductions
            unit.record_to(self.timeline)
        self.comm_state = attach_comm_hook(self.wrapped_model, self.args, self.world)
        """PowerSGD's state (error feedback, warm-start Qs) when ddp_comm_hook="powersgd"."""
        if optimizer is not None:
            check_user_optimizer(optimizer, self.args)
        self.optimizer = (
            optimizer
            if optimizer is not None
            else build_optimizer(self.model, self.args, self.world)
        )
        """AdamW, or under zero_stage 1/2 a phalanx.ZeroRedundancyOptimizer over AdamW."""
        record_offload_to(self.optimizer, self.timeline)
        self.periodic_sync = make_periodic_sync(self.model, self.optimizer, self.args, self.world)
        """phalanx.LocalSGD or DiLoCo under sync_method "local_sgd" / "diloco", else None."""
        self.scaler = torch.amp.GradScaler("cuda") if self.args.fp16 else None

    def _setup_training(self, dataset: Dataset[Any]) -> None:
        args = self.args
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=self.world.world_size,
            rank=self.world.rank,
            shuffle=True,
            seed=args.seed,
            pad=args.even_batches,
        )
        # Its own generator: making an iterator must not draw from the global RNG,
        # or a resumed run (which makes one mid-epoch) would shift the dropout masks.
        self._loader_generator = torch.Generator()
        self.train_loader = train_loader(
            dataset, self.sampler, args, self.collate_fn, self._loader_generator
        )
        self.micro_batches_per_epoch = len(self.train_loader)
        if not args.even_batches:  # the longest rank's epoch: every rank counts the same steps
            lengths: list[int] = self.world.all_gather_object(len(self.train_loader))
            self.micro_batches_per_epoch = max(lengths)
        steps_per_epoch = math.ceil(self.micro_batches_per_epoch / args.gradient_accumulation_steps)
        self.max_steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * steps_per_epoch)
        )
        self.scheduler = make_scheduler(
            self.optimizer, args.lr_scheduler_type, args.warmup_steps, self.max_steps
        )
        self._checkpointer = Checkpointer(self.world, Path(args.output_dir), args.save_total_limit)
        self._guard = NonFiniteGuard(
            self.world, args.on_nonfinite_grad, args.max_consecutive_skips, self._report.say
        )
        self._stop_requests = StopRequests(self.world)
        self._stepper = StepRunner(
            self.model,
            self.wrapped_model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            args,
            self.world,
            self._guard,
            self.timeline,
        )
        self._make_entries()

    def _make_entries(self) -> None:
        """The adapters over the loop's own state (see trainer_state.py), for `self.state`."""
        assert self.sampler is not None
        self._counters = Counters(self.state, self.args, self.world)
        self._position = SamplerPosition(
            self.sampler, self.state, self.args, self.micro_batches_per_epoch
        )
        self._rng = RngStreams()

    def checkpoint_states(self) -> dict[str, Entry]:
        """Everything a checkpoint holds, one entry each: new state is one more entry here.

        The placement of each (stateful.py) says who writes it: the ZeRO
        optimizer is sharded, "rng" per rank, the rest replicated. "trainer"
        comes first: it loads the counters the others' messages use.
        """
        sharded = self.args.zero_stage == 3  # the model holds pieces: both go through DCP
        states: dict[str, Entry] = {
            "trainer": self._counters,
            "model": ShardedModel(self.model) if sharded else self.model,
            "optimizer": ShardedModel(self.model, self.optimizer) if sharded else self.optimizer,
            "scheduler": self.scheduler,
        }
        local = self.comm_state if self.comm_state is not None else self.periodic_sync
        if local is not None:  # after model and optimizer: LocalSGD's holds this rank's own
            states["comm"] = PerRank(local)
        if self.scaler is not None:
            states["scaler"] = self.scaler
        states["sampler"] = self._position
        states["rng"] = self._rng
        return states

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast_for(self.args, self.world.device)

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainOutput:
        """Train to max_steps (or num_train_epochs), resuming from a checkpoint if asked.

        `resume_from_checkpoint=True` picks the newest valid checkpoint in
        output_dir (falling back past corrupt ones with a warning) and starts
        afresh when there is none yet; a path resumes from exactly that one.
        Without it, an output_dir that holds checkpoints is an error unless
        `overwrite_output_dir` is set.
        """
        self._check_open()
        if self.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset — pass one to the Trainer")
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else False
        restart = restart_note()
        if restart is not None:
            self._report.say(f"{restart}: " + ("resuming…" if resume else "starting afresh"))
        prepare_output_dir(self.world, self.args, fresh=resume is False)
        seed_everything(self.args.seed)
        self.state = TrainState()
        self._make_entries()
        resumed_from = None if resume is False else self._resume(resume)
        if self.state.global_step >= self.max_steps:
            self._rng.restore()
            self._report.say(f"already at max_steps ({self.max_steps}) — nothing to do")
            return TrainOutput(self.state.global_step, self._mean_loss(), 0.0, 0.0, resumed_from)
        keep_until = self.state.global_step if resumed_from is not None else 0
        with timelines.span_of(self.timeline, "open run (barrier)"):
            self._report.open(self.max_steps, self.state.global_step, keep_until)
        self._rng.restore()  # last, so nothing above can shift the dropout masks
        self._saved_step = self.state.global_step if self._resumed_here(resumed_from) else None
        try:
            with self._stop_requests.installed(self.args.save_on_signal):
                self._loop()
                if self._stopped_by is not None:
                    raise self._stop_and_save(self._stopped_by)
        finally:
            self._report.close()
        return self._output(resumed_from)

    def _resumed_here(self, resumed_from: str | None) -> bool:
        """Whether the checkpoint resumed from is output_dir's own: no need to write it again."""
        return resumed_from is not None and Path(resumed_from).parent == Path(self.args.output_dir)

    def _resume(self, resume_from: bool | str | Path) -> str | None:
        path = self._checkpointer.choose(resume_from)
        if path is None:
            self._report.say(f"no checkpoint in {self.args.output_dir} yet: starting at step 0")
            return None
        self._checkpointer.load(path, self.checkpoint_states())
        warning = resume_warning(path.name, self._counters, self._position)
        if warning is not None and self.world.is_main:
            warnings.warn(warning, ResumeWarning, stacklevel=3)
        state = self.state
        sample = self._position.consumed() * self.world.world_size
        self._report.say(
            f"resumed from {path.name} (step {state.global_step}, epoch {state.epoch}, "
            f"sample {sample} of the epoch)"
        )
        return str(path)

    def _loop(self) -> None:
        """Train until max_steps, or until the ranks agree to stop at a step boundary."""
        comm = CommMeter(self.wrapped_model, self.periodic_sync, self.optimizer)
        self._runlog = RunLog(self.world, self._report, comm, self.timeline)
        self._loss_before = self.state.loss_sum
        while not self._train_epoch():
            self.state.epoch += 1
            self.state.batches_done = 0
        if self._runlog.window.steps:
            self._log()

    def _train_epoch(self) -> bool:
        """Train the rest of this epoch; True when training ends in it (max_steps, or a stop).

        The stop is agreed before each step's data is loaded (a dataset that draws
        random numbers would otherwise have drawn them for a step never trained) and
        once after the last step, so a signal during it is honoured as well.
        """
        with uneven_inputs(self.wrapped_model, self.args.even_batches) as shadow:
            self._stepper.shadow = shadow
            steps = self._epoch_steps()
            while not self._stop_agreed() and self.state.global_step < self.max_steps:
                batches, expected = next(steps, ([], 0))
                if shadow is None:  # no one to shadow: a loader shorter than its len() ends here
                    expected = len(batches)
                if not expected:
                    return False
                self._train_step(batches, expected)
        return True

    def _stop_agreed(self) -> bool:
        self._stopped_by = self._stop_requests.agree()
        return self._stopped_by is not None

    def _epoch_steps(self) -> Iterator[tuple[list[Any], int]]:
        """This epoch's steps from the current position on: (this rank's micro-batches, how
        many the step has on the longest rank)."""
        assert self.sampler is not None
        self.sampler.set_epoch(self.state.epoch)
        self._loader_generator.manual_seed(self.args.seed + self.state.epoch)
        return step_groups(
            iter(self.train_loader),
            self.state.batches_done,
            self.args.gradient_accumulation_steps,
            self.micro_batches_per_epoch,
        )

    def _train_step(self, batches: list[Any], expected: int) -> None:
        result = self._stepper.run(batches, expected, self.loss_fn, self.state)
        self.state.batches_done += expected
        self.state.global_step += 1
        progress.step(self.state.global_step + 1)
        assert self._runlog is not None
        self._runlog.add(result)
        self._report.advance()
        self._after_step()

    def _after_step(self) -> None:
        """Between steps, on every rank alike: replica check, logging, evaluation, saving."""
        step, args = self.state.global_step, self.args
        local = self.periodic_sync
        if local is not None and step == self.max_steps:
            local.sync()  # the run ends with one model (a no-op right after a sync)
        in_sync = local is None or local.in_sync  # the same on every rank
        if args.replica_check_steps and step % args.replica_check_steps == 0 and in_sync:
            check_replicas(self.wrapped_model, self.world.process_group)
        if step % args.logging_steps == 0:
            self._log()
        if args.eval_steps and step % args.eval_steps == 0:
            self.evaluate()
        if args.save_steps and (step % args.save_steps == 0 or step == self.max_steps):
            self.save_checkpoint()

    def _stop_and_save(self, stop: Stop) -> TrainingStopped:
        """Every rank agreed to stop: save at this step (unless done already) and say so, on
        the console and to the launcher, whose summary then names the rank signalled."""
        step = self.state.global_step
        path = Path(self.args.output_dir) / f"{PREFIX}{step}"
        if self._saved_step != step:
            path = self.save_checkpoint()
        stopped = TrainingStopped(stop.signum, step, path.name, stop.received_by)
        note = f"{stopped} — resume with resume_from_checkpoint=True"
        self._report.say(note)
        progress.note_stop(note)
        return stopped

    # ---------------------------------------------------------------- logging
    def _log(self) -> None:
        """One log line for the steps since the last (every rank calls this)."""
        assert self._runlog is not None
        state = self.state
        extra = {
            "lr": float(self.scheduler.get_last_lr()[0]),
            "epoch": state.epoch + state.batches_done / self.micro_batches_per_epoch,
        }
        if self.args.on_nonfinite_grad == "skip":
            extra["skipped_steps"] = float(state.skipped_steps)
        self._runlog.log(state.global_step, extra)

    def _sync_loss(self) -> dict[str, float]:
        """Collective: fold this call's step losses into state.loss_sum; the call's summary."""
        if self._runlog is None:
            return {}
        summary = self._runlog.summary()
        steps = self._runlog.run.steps
        self.state.loss_sum = self._loss_before + summary.get("loss", 0.0) * steps
        return summary

    def _mean_loss(self) -> float:
        steps = self.state.global_step - self.state.skipped_steps
        return self.state.loss_sum / steps if steps else math.nan

    def _output(self, resumed_from: str | None) -> TrainOutput:
        summary = self._sync_loss()
        self._runlog = None
        return TrainOutput(
            global_step=self.state.global_step,
            train_loss=self._mean_loss(),
            samples_per_second=summary.get("samples_per_second", 0.0),
            runtime_s=summary.get("window_s", 0.0),
            resumed_from=resumed_from,
        )

    def close(self) -> None:
        """Let go of the process group; the Trainer cannot train or evaluate afterwards.

        Unhooks DDP from the model (`trainer.model` stays usable) and destroys
        the group if this Trainer created it. At interpreter exit the group is
        torn down by the hook `phalanx.init()` registers; call this to release
        it earlier.
        """
        if self._closed:
            return
        self._closed = True
        # A constructor that failed half-way (a bad model) may have no wrapped model yet.
        wrapped = self.__dict__.get("wrapped_model")
        if wrapped is not None:
            self.wrapped_model = self.model
        local: PeriodicSync | None = self.__dict__.get("periodic_sync")
        if local is not None:
            local.close()  # unhook the optimizer, which outlives the Trainer
        release(wrapped, self._owns_group, self.__dict__.get("optimizer"))

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(
                "this Trainer was closed and has let go of the process group — make a new one"
            )

    # ------------------------------------------------------ evaluate and save
    def evaluate(self, eval_dataset: Dataset[Any] | None = None) -> dict[str, float]:
        """eval_loss over the whole eval set (each sample once) plus compute_metrics' results.

        Every rank must call it; every rank gets the same dict.
        """
        self._check_open()
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigurationError("evaluate() needs an eval_dataset — pass one to the Trainer")
        setup = EvalSetup(
            world=self.world,
            batch_size=self.args.per_device_eval_batch_size,
            num_workers=self.args.dataloader_num_workers,
            collate_fn=self.collate_fn,
            loss_fn=self.loss_fn,
            autocast=self._autocast,
        )
        metrics = evaluate_model(self.model, dataset, setup, self.compute_metrics)
        emit(self._report, self.timeline, self.state.global_step, metrics)
        return metrics

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-<step>/ now (every rank must call it)."""
        self._check_open()
        if self.sampler is None:
            raise ConfigurationError("save_checkpoint() needs a train_dataset — pass one")
        step = self.state.global_step
        check_parameters(self.model, self.world, step)  # never a NaN checkpoint over good ones
        self._sync_loss()
        notes = {"args.json": json.dumps(self.args.to_dict(), indent=1).encode()}
        with timelines.span_of(self.timeline, "checkpoint save"):
            saved = self._checkpointer.save(self.checkpoint_states(), step, notes)
        self._saved_step = step
        self._report.say(
            f"saved {saved.path.name} ({human_size(saved.bytes)}, {saved.seconds:.2f} s)"
        )
        return saved.path
