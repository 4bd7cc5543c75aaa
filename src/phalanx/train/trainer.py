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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from phalanx.ddp.powersgd import PowerSGDState
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.timeline import Timeline
from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.train.batches import LossFn
from phalanx.train.checkpoint import hf_save
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.cluster import ClusterReport
from phalanx.train.config.args import TrainingArguments
from phalanx.train.evaluation import ComputeMetrics, evaluate_model
from phalanx.train.flow import record_save
from phalanx.train.live import restart_if_lost
from phalanx.train.logging.runlog import TrafficSource, emit
from phalanx.train.loop import TrainingLoop
from phalanx.train.nonfinite import check_parameters
from phalanx.train.plan.choose import Choice
from phalanx.train.run_start import RunStart
from phalanx.train.saving import CheckpointSaves
from phalanx.train.strategy import Strategy
from phalanx.train.trainer_setup import TrainerSetup
from phalanx.train.trainer_state import TrainOutput, TrainState


class Trainer:
    """Train `model` on `train_dataset` as `args` says; see docs/trainer.md.

    model: built on the CPU or on the meta device (docs/zero.md); the Trainer moves,
        wraps or shards it. args: TrainingArguments (default: all defaults).
    train_dataset / eval_dataset: map-style (sharded by a DistributedSampler), or for
        training a streaming IterableDataset. loss_fn: `loss_fn(outputs, batch)`; None
        takes the loss the model returns.
    optimizer: yours, at any stage; None builds `args.optim`. optimizers /
        optimizer_cls_and_kwargs: Hugging Face's, built after sharding.
    collate_fn / data_collator: how samples become a batch (one of the two).
    compute_metrics: `compute_metrics(EvalPrediction) -> dict` at evaluation.
    callbacks: Hugging Face's (train/callbacks.py), on every rank.

    One class, composed of what its constructor builds: `setup` (trainer_setup.py: the
    world, the model and optimizer, the data, the callbacks, the checkpoint entries),
    `saves` (saving.py: checkpoints, written now or in the background) and `cluster`
    (cluster.py: what Ray Train is told) and `loop` (loop.py: the steps of a train() call).
    Evaluation and the public face are here.
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
        arguments: the class docstring)."""
        with restart_if_lost():  # live recovery: a member lost before the first step
            self.setup = setup = TrainerSetup(
                model,
                args,
                train_dataset,
                eval_dataset,
                loss_fn,
                optimizer,
                collate_fn,
                compute_metrics,
                callbacks,
                data_collator,
                optimizers,
                optimizer_cls_and_kwargs,
            )
        """What the run is made of; live recovery rebuilds its parts in place (train/live.py)."""
        self._report, self._callbacks = setup.report, setup.callbacks  # the setup's own
        self.cluster = ClusterReport(setup, self._report)
        """What Ray Train is told, and where it says to resume (a no-op elsewhere)."""
        parts = (setup.args, setup.model, setup.tied, setup.checkpointer, self._report)
        self.saves = CheckpointSaves(*parts, self._callbacks, self.cluster.checkpoint_sealed)
        """The checkpoints this Trainer writes, the one in flight among them."""
        self._start = RunStart(setup, self.cluster, self.saves)
        # Looked up at each call, so that a subclass's or a test's evaluate/_save is the one run.
        self.loop = TrainingLoop(
            setup, self.saves, lambda: self.evaluate(), lambda b: self._save(b)
        )
        """The steps of a train() call (loop.py)."""

    # ----------------------------------------------------- what it is made of
    @property
    def model(self) -> nn.Module:
        """The unwrapped module: what you save, export, or evaluate yourself."""
        return self.setup.model

    @property
    def args(self) -> TrainingArguments:
        """The arguments the run trains with ("auto" resolved by the planner)."""
        return self.setup.args

    @property
    def optimizer(self) -> Optimizer:
        """AdamW (or yours), or under zero_stage 1/2 a ZeroRedundancyOptimizer over it."""
        return self.setup.optimizer

    @property
    def scheduler(self) -> LRScheduler:
        """The learning-rate schedule (with a train_dataset)."""
        return self.setup.scheduler

    @property
    def state(self) -> TrainState:
        """The step, the epoch, the loss so far, the best metric (trainer_state.py)."""
        return self.setup.state

    @property
    def world(self) -> World:
        """Rank, world size, device and group (a new one after a live recovery)."""
        return self.setup.world

    @property
    def strategy(self) -> Strategy:
        """How the run is data-parallel (train/strategy/)."""
        return self.setup.strategy

    @property
    def timeline(self) -> Timeline | None:
        """The process's timeline (phalanx.diagnostics.timeline), or None when off."""
        return self.setup.timeline

    @property
    def plan(self) -> Choice | None:
        """What the planner chose for zero_stage / zero_offload "auto", else None."""
        return self.setup.plan

    @property
    def comm_state(self) -> PowerSGDState | None:
        """PowerSGD's state (error feedback, warm-start Qs) when ddp_comm_hook="powersgd"."""
        return self.setup.comm_state

    @property
    def loss_fn(self) -> LossFn | None:
        """`loss_fn(outputs, batch)`, or None: the loss the model returns."""
        return self.setup.loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn: LossFn | None) -> None:
        self.setup.loss_fn = loss_fn

    @property
    def wrapped_model(self) -> nn.Module:
        """What the loop calls: phalanx DDP, the sharded root at stage 3, or the model."""
        return self.setup.wrapped_model

    def checkpoint_states(self) -> dict[str, Entry]:
        """Everything a checkpoint holds, one entry each (TrainerSetup.checkpoint_states)."""
        return self.setup.checkpoint_states()

    def rewrap(self) -> None:
        """Wrap the model again for the current world (live recovery)."""
        self.setup.rewrap()

    def replace_optimizer(self, optimizer: Optimizer) -> None:
        """Make `optimizer` the one everything steps and reads (live recovery at ZeRO-1/2)."""
        self.setup.replace_optimizer(optimizer)

    def traffic_source(self) -> TrafficSource:
        """What the log's traffic figures read (the strategy's sum of every sender)."""
        return self.setup.traffic_source()

    def close(self) -> None:
        """Let go of the process group; the Trainer cannot train or evaluate afterwards.

        Unhooks DDP from the model (`trainer.model` stays usable) and destroys the group if
        this Trainer created it. At interpreter exit the group is torn down by the hook
        `phalanx.init()` registers; call this to release it earlier.
        """
        self.setup.close()

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainOutput:
        """Train to max_steps (or num_train_epochs), resuming from a checkpoint if asked.

        `resume_from_checkpoint=True` picks the newest valid checkpoint in
        output_dir (falling back past corrupt ones with a warning) and starts
        afresh when there is none yet; a path resumes from exactly that one.
        Without it, an output_dir that holds checkpoints is an error unless
        `overwrite_output_dir` is set.
        """
        setup = self.setup
        setup.check_open()
        if setup.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset — pass one to the Trainer")
        resumed_from: str | None = None
        if setup.live is not None and setup.live.is_replacement:
            self._start.join()
        else:
            with restart_if_lost():
                resumed_from, steps_left = self._start.begin(resume_from_checkpoint)
            if not steps_left:
                done = (self.state.global_step, self.setup.mean_loss(), 0.0, 0.0, resumed_from)
                return TrainOutput(*done, self.world.launcher)
        try:
            with setup.stop_requests.installed(self.args.save_on_signal):
                stopped = self.loop.run()
                if setup.live is not None:
                    setup.live.finish()
                if stopped is not None:
                    raise self.loop.stop_and_save(stopped)
                self.saves.collect()
            self._start.load_best()
            self._callbacks.fire("on_train_end")
            self._callbacks.agree()
        except Exception:
            self.saves.settle()  # a save in flight completes before the error leaves
            raise
        finally:
            self._report.close()
        return self._output(resumed_from)

    def _output(self, resumed_from: str | None) -> TrainOutput:
        summary = self.setup.settle_loss()
        self.setup.runlog = None
        self.cluster.finish()
        return TrainOutput(
            global_step=self.state.global_step,
            train_loss=self.setup.mean_loss(),
            samples_per_second=summary.get("samples_per_second", 0.0),
            runtime_s=summary.get("window_s", 0.0),
            resumed_from=resumed_from,
            launcher=self.world.launcher,
        )

    # ------------------------------------------------------ evaluate and save
    def evaluate(self, eval_dataset: Dataset[Any] | None = None) -> dict[str, float]:
        """eval_loss over the whole eval set (each sample once) plus compute_metrics' results.

        Every rank must call it; every rank gets the same dict.
        """
        setup = self.setup
        setup.check_open()
        dataset = eval_dataset if eval_dataset is not None else setup.eval_dataset
        if dataset is None:
            raise ConfigurationError("evaluate() needs an eval_dataset — pass one to the Trainer")
        metrics = evaluate_model(self.model, dataset, setup.evaluation(), setup.compute_metrics)
        emit(self._report, self.timeline, self.state.global_step, metrics)
        self._callbacks.log(metrics)
        self._callbacks.fire("on_evaluate", metrics=metrics)
        return metrics

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The model alone, in Hugging Face's format, into `output_dir` (args.output_dir by
        default), as HF's Trainer.save_model; every rank must call it."""
        self.setup.check_open()
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        sharded = self.strategy.sharded_model
        hf_save.save_model(self.model, self.world, out, self.setup.tied, sharded)
        self._report.say(f"saved the model in Hugging Face's format to {out}")
        return out

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-<step>/ now (every rank must call it); it is complete
        when this returns (a save in flight is completed first)."""
        return self._save(background=False)

    def _save(self, background: bool) -> Path:
        """Save at this step: stage and hand to the writer thread, or write now."""
        self.setup.check_open()
        if self.setup.sampler is None and self.setup.stream is None:
            raise ConfigurationError("save_checkpoint() needs a train_dataset — pass one")
        step, saves = self.state.global_step, self.saves
        saves.collect(next_step=step)  # one save in flight at a time
        if not background:  # a background save checks its copy, on the writer (off the loop)
            check_parameters(self.model, self.world, step)  # never a NaN checkpoint
        self.setup.settle_loss()  # the checkpoint's loss_sum counts every step so far
        with timelines.span_of(self.timeline, "checkpoint save"):
            best = self.state.best_model_checkpoint
            streamer = self.strategy.offload_streamer(self.optimizer)
            path = saves.save(self.checkpoint_states(), step, best, background, streamer)
        record_save(self.state, path)
        return path
