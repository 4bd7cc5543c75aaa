"""`TrainerSetup`: what a Trainer is made of, built in the order a run needs it.

Joining the world (a one-rank group for a plain process), the model on its
device (materialised from the meta device, sharded at stage 3, wrapped in DDP
with more than one rank), the optimizer, the data and its sampler, the
schedule, the checkpointer and its entries, and the callbacks; and `close()`,
which lets go of them. A `Trainer` owns one (`trainer.setup`) and runs the loop
over it (trainer.py); live recovery rebuilds its parts in place for a new world
(train/live.py), so everything that holds the world is reached through it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset, IterableDataset

from phalanx.data.lengths import check_same_length
from phalanx.data.sampler import DistributedSampler
from phalanx.diagnostics import timeline as timelines
from phalanx.errors import ConfigurationError
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.runtime import shutdown
from phalanx.train.batches import LossFn
from phalanx.train.callbacks import Callbacks
from phalanx.train.checkpoint import hf_save
from phalanx.train.checkpoint.checkpointer import Checkpointer
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.collate import DefaultCollator, forward_columns, one_collator
from phalanx.train.comm import PerRank, make_periodic_sync
from phalanx.train.config.args import TrainingArguments
from phalanx.train.evaluation import ComputeMetrics, EvalSetup
from phalanx.train.live import live_training_for
from phalanx.train.logging.report import RunReport
from phalanx.train.logging.runlog import RunLog, TrafficSource, continue_from
from phalanx.train.nonfinite import NonFiniteGuard
from phalanx.train.plan.auto import planned_arguments
from phalanx.train.schedules import make_scheduler, warmup_steps_for
from phalanx.train.setup import check_same_arguments, join_world, train_loader
from phalanx.train.step import StepRunner, autocast_for
from phalanx.train.stopping import StopRequests
from phalanx.train.strategy import OptimizerChoice, Strategy, strategy_for
from phalanx.train.streams import Stream, StreamPosition, is_stream
from phalanx.train.trainer_state import (
    Counters,
    DataPosition,
    RngStreams,
    SamplerPosition,
    TrainState,
)


class TrainerSetup:
    """A Trainer's parts and their teardown: the world, the model and optimizer, the data,
    the callbacks, the loop's state, and the checkpoint entries over them (the loop, which
    owns this, is `Trainer`'s).
    """

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
        callbacks: list[Any] | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        optimizers: tuple[Optimizer | None, LRScheduler | None] | None = None,
        optimizer_cls_and_kwargs: tuple[type[Optimizer], dict[str, Any]] | None = None,
    ) -> None:
        """Join the world, then prepare the model, optimizer, data and callbacks (the
        arguments are `Trainer`'s: trainer.py says what each is)."""
        self.args = args if args is not None else TrainingArguments()
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.loss_fn = loss_fn
        self.collate_fn = one_collator(collate_fn, data_collator)
        """How samples become a batch; None until the model is known, then the default."""
        self.compute_metrics = compute_metrics
        self._init_loop_state()
        self.world, self._owns_group = join_world(self.args)
        """Rank, world size, device, and the group: one of one rank for a plain process."""
        self.report = RunReport(self.world, self.args)
        path, world = self.args.timeline or os.environ.get(timelines.ENV), self.world
        self.timeline = timelines.start(path, world.rank, world.world_size) if path else None
        """The process's timeline (phalanx.diagnostics.timeline), or None when off."""
        self._closed = False
        try:
            check_same_arguments(self.args, self.world)  # before any collective of the run
            choice = OptimizerChoice.of(optimizer, optimizers, optimizer_cls_and_kwargs)
            self.args, self.plan = planned_arguments(self, model, choice)  # "auto" resolved
            args = self.args
            self.checkpointer = Checkpointer(
                self.world, Path(args.output_dir), args.save_total_limit, self.report.say
            )
            self._setup_model(model, choice)
            if train_dataset is not None:
                self._setup_training(train_dataset)
            self.callbacks = self._setup_callbacks(callbacks)
            self.live = live_training_for(self)
            """fault_tolerance="live": the survivors go on after a loss (train/live.py)."""
        except BaseException:
            self.close()  # a Trainer that could not be made must not keep its group
            raise

    def _init_loop_state(self) -> None:
        """What the loop keeps between train() calls, before any is made."""
        self.state = TrainState()
        self.runlog: RunLog | None = None
        """The log window and totals of the train() call under way (train/logging/runlog.py)."""
        self.sampler: DistributedSampler | None = None
        self.stream: Stream | None = None
        """A streaming train_dataset's part for this rank (streams.py); then no sampler."""

    # ------------------------------------------------------------------ setup
    def _setup_model(self, model: nn.Module, choice: OptimizerChoice) -> None:
        self.tied = hf_save.tied_copies(model)  # before sharding: ties are identities here
        self.strategy = strategy_for(self.args, self.world, choice, self.timeline)
        """How the run is data-parallel (train/strategy/): the only reader of zero_stage, and
        the owner of the wrapper, the offload files and what differs between the stages."""
        self.model: nn.Module = self.strategy.prepare(model)
        """The unwrapped module: what you save, export, or evaluate yourself."""
        if self.collate_fn is None:  # Hugging Face's default: needs the model's forward
            columns = forward_columns(self.model) if self.args.remove_unused_columns else None
            self.collate_fn = DefaultCollator(columns)
        self.strategy.wrap(self.model)
        self.comm_state = self.strategy.attach_comm_hook()
        """PowerSGD's state (error feedback, warm-start Qs) when ddp_comm_hook="powersgd"."""
        self.optimizer = self.strategy.build_optimizer(self.model)
        """AdamW (or yours), or under zero_stage 1/2 a ZeroRedundancyOptimizer over it."""
        self.periodic_sync = make_periodic_sync(self.model, self.optimizer, self.args, self.world)
        """phalanx.LocalSGD or DiLoCo under sync_method "local_sgd" / "diloco", else None."""
        self.scaler = torch.amp.GradScaler("cuda") if self.args.fp16 else None

    def _setup_training(self, dataset: Dataset[Any]) -> None:
        if is_stream(dataset):
            self._setup_stream(dataset)
        else:
            self._setup_sampler(dataset)
        self._setup_steps()

    def _setup_stream(self, dataset: IterableDataset[Any]) -> None:
        """A streaming training set (streams.py): each rank reads its own part, no sampler."""
        self.stream = Stream(dataset, self.world, self.args, self.collate_fn)
        self.train_loader = self.stream.loader
        self.micro_batches_per_epoch = sys.maxsize  # unknown: the ranks agree when a pass ends
        self.max_steps = self.args.max_steps

    def _setup_sampler(self, dataset: Dataset[Any]) -> None:
        args = self.args
        if isinstance(dataset, Sized):  # else the sampler says it needs a length
            # Ranks dealt different lengths would repeat and skip samples, or hang (lengths.py).
            world = self.world
            check_same_length(dataset, world.process_group, "training set", world.device)
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
        self.loader_generator = torch.Generator()
        self.train_loader = train_loader(
            dataset, self.sampler, args, self.collate_fn, self.loader_generator
        )
        self.micro_batches_per_epoch = len(self.train_loader)
        if not args.even_batches:  # the longest rank's epoch: every rank counts the same steps
            lengths: list[int] = self.world.all_gather_json(len(self.train_loader))
            self.micro_batches_per_epoch = max(lengths)
        steps_per_epoch = math.ceil(self.micro_batches_per_epoch / args.gradient_accumulation_steps)
        self.max_steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * steps_per_epoch)
        )

    def _setup_steps(self) -> None:
        """What a step needs, whatever the data: the schedule, checkpointer, guard, stepper."""
        args = self.args
        warmup = warmup_steps_for(args.warmup_steps, args.warmup_ratio, self.max_steps)
        given = self.strategy.scheduler_for(self.optimizer)  # optimizers=(..., scheduler)
        self.scheduler: LRScheduler = given or make_scheduler(
            self.optimizer, args.lr_scheduler_type, warmup, self.max_steps, args.lr_scheduler_kwargs
        )
        self.guard = NonFiniteGuard(
            self.world, args.on_nonfinite_grad, args.max_consecutive_skips, self.report.say
        )
        self.stop_requests = StopRequests(self.world)
        self.stepper = StepRunner(
            self.model,
            self.strategy,
            self.optimizer,
            self.scheduler,
            self.scaler,
            args,
            self.world,
            self.guard,
            self.timeline,
        )
        self.make_entries()

    def _setup_callbacks(self, callbacks: list[Any] | None) -> Callbacks:
        """Hugging Face's callbacks (callbacks.py), with the objects its events pass."""
        handler = Callbacks(callbacks, self.args, self.world)
        handler.objects = {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.__dict__.get("scheduler"),
            "train_dataloader": self.__dict__.get("train_loader"),
            "eval_dataloader": None,
            "processing_class": None,
        }
        handler.source = self._callback_view
        handler.fire("on_init_end")
        handler.agree()
        return handler

    def _callback_view(self) -> dict[str, Any]:
        state = self.state
        per_epoch = self.__dict__.get("micro_batches_per_epoch") or 1
        return {
            "global_step": state.global_step,
            "epoch": self.epoch_progress(per_epoch),
            "max_steps": self.__dict__.get("max_steps", 0),
            "num_train_epochs": self.args.num_train_epochs,
            "logging_steps": self.args.logging_steps,
            "eval_steps": self.args.eval_steps,
            "save_steps": self.args.save_steps,
            "train_batch_size": self.args.per_device_train_batch_size,
            "best_metric": state.best_metric,
            "best_global_step": state.best_global_step,
            "best_model_checkpoint": state.best_model_checkpoint,
        }

    def make_entries(self) -> None:
        """The adapters over the loop's own state (see trainer_state.py), for `self.state`."""
        self.counters = Counters(self.state, self.args, self.world)
        self.position: DataPosition
        if self.stream is not None:
            batch = self.args.per_device_train_batch_size
            self.position = StreamPosition(self.stream, self.state, batch)
        else:
            assert self.sampler is not None
            self.position = SamplerPosition(
                self.sampler, self.state, self.args, self.micro_batches_per_epoch
            )
        self.rng = RngStreams()

    @property
    def wrapped_model(self) -> nn.Module:
        """What the loop calls: phalanx DDP with more than one rank, the sharded root at
        stage 3, else the model itself (the strategy's; the model once closed)."""
        wrapped = self.strategy.wrapped
        return wrapped if wrapped is not None else self.model

    def checkpoint_states(self) -> dict[str, Entry]:
        """Everything a checkpoint holds, one entry each: new state is one more entry here.

        The placement of each (stateful.py) says who writes it: the ZeRO
        optimizer is sharded, "rng" per rank, the rest replicated. "trainer"
        comes first: it loads the counters the others' messages use.
        """
        states: dict[str, Entry] = {
            "trainer": self.counters,
            **self.strategy.checkpoint_entries(self.model, self.optimizer),
            "scheduler": self.scheduler,
        }
        local = self.comm_state if self.comm_state is not None else self.periodic_sync
        if local is not None:  # after model and optimizer: LocalSGD's holds this rank's own
            states["comm"] = PerRank(local)
        if self.scaler is not None:
            states["scaler"] = self.scaler
        states["stream" if self.stream is not None else "sampler"] = self.position
        states["rng"] = self.rng
        return states

    def rewrap(self) -> None:
        """Wrap the model again for the current world (live recovery, after the members
        changed): phalanx DDP over the new group, or the model itself in a world of one."""
        self.strategy.rewrap(self.model)
        if self.runlog is not None:
            self.runlog.traffic = continue_from(self.traffic_source(), self.runlog.traffic())

    def replace_optimizer(self, optimizer: Optimizer) -> None:
        """Live recovery at ZeRO-1/2 builds the new world's optimizer: everything that steps or
        reads the optimizer follows it (the scheduler, the step, the callbacks, the log)."""
        self.optimizer = optimizer
        self.scheduler.optimizer = optimizer
        self.stepper.optimizer = optimizer
        self.callbacks.objects["optimizer"] = optimizer
        if self.runlog is not None:
            self.runlog.traffic = continue_from(self.traffic_source(), self.runlog.traffic())

    def traffic_source(self) -> TrafficSource:
        """What the log's traffic figures read: the strategy's sum of whatever sent them
        (the wrapper, the local sync, ZeRO, stage 3's units)."""
        return functools.partial(self.strategy.traffic, self.optimizer, self.periodic_sync)

    def epoch_progress(self, per_epoch: int | None = None) -> float:
        """Epochs done, the current one's fraction included (after a live recovery dealt the
        rest of an epoch over a new world, counted in the epoch's samples)."""
        state, sampler = self.state, self.sampler
        if sampler is not None and sampler.base:
            batch = self.args.per_device_train_batch_size
            mine = min(state.batches_done * batch, len(sampler))
            return state.epoch + (sampler.base + mine * sampler.num_replicas) / sampler.total_size
        return state.epoch + state.batches_done / (per_epoch or self.micro_batches_per_epoch)

    def set_epoch_length(self, micro_batches: int) -> None:
        """This rank's micro-batches in the epoch (from the current position, after a
        live recovery dealt the rest of it over a new world)."""
        self.micro_batches_per_epoch = micro_batches
        if isinstance(self.position, SamplerPosition):
            self.position.micro_batches_per_epoch = micro_batches

    def evaluation(self) -> EvalSetup:
        """What evaluation borrows: the world, the eval batch, the collator, the loss."""
        args = self.args
        autocast = functools.partial(autocast_for, args, self.world.device)
        workers = args.dataloader_num_workers
        batch = args.per_device_eval_batch_size
        return EvalSetup(self.world, batch, workers, self.collate_fn, self.loss_fn, autocast)

    def close(self) -> None:
        """Let go of the process group; the Trainer cannot train or evaluate afterwards.

        Unhooks DDP from the model (`trainer.model` stays usable) and destroys the group if
        this Trainer created it. At interpreter exit the group is torn down by the hook
        `phalanx.init()` registers; call this to release it earlier.
        """
        if self._closed:
            return
        self._closed = True
        local: PeriodicSync | None = self.__dict__.get("periodic_sync")
        if local is not None:
            local.close()  # unhook the optimizer, which outlives the Trainer
        # A constructor that failed half-way (a bad model) may have no strategy yet.
        strategy: Strategy | None = self.__dict__.get("strategy")
        if strategy is not None:
            strategy.release(self.__dict__.get("optimizer"))
            strategy.wrapped = None
        if self._owns_group:
            shutdown()

    def open_runlog(self) -> RunLog:
        """The train() call's log and loss tally, from the loss summed so far."""
        self.runlog = RunLog(self.world, self.report, self.traffic_source(), self.timeline)
        self.runlog.loss_from(self.state.loss_sum, self.counted_steps())
        return self.runlog

    def fold_loss(self) -> None:
        """Live recovery, on every member once the state is shared (collective): fold the
        run window's loss into loss_sum and count on from there, so that members who trained
        different steps (a replacement, none) report one train_loss. The steps a lost member
        trained count at the survivors' mean."""
        runlog = self.runlog or self.open_runlog()
        self.state.loss_sum, _ = runlog.settle_loss(self.counted_steps())
        runlog.run.reset(runlog.traffic().wait_s)
        runlog.loss_from(self.state.loss_sum, self.counted_steps())

    def counted_steps(self) -> int:
        """Steps whose loss counts (a skipped step's does not)."""
        return self.state.global_step - self.state.skipped_steps

    def mean_loss(self) -> float:
        """The mean step loss over the whole run; NaN before any step counts."""
        steps = self.counted_steps()
        return self.state.loss_sum / steps if steps else math.nan

    def settle_loss(self) -> dict[str, float]:
        """Collective: fold this call's step losses into state.loss_sum; the call's summary."""
        if self.runlog is None:
            return {}
        self.state.loss_sum, summary = self.runlog.settle_loss(self.counted_steps())
        return summary

    def check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(
                "this Trainer was closed and has let go of the process group — make a new one"
            )
