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

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.replicas import check_replicas
from phalanx.errors import ConfigurationError, PeerLost
from phalanx.ground import progress_record
from phalanx.train.batches import step_groups
from phalanx.train.checkpoint import hf_save
from phalanx.train.checkpoint.directory import PREFIX
from phalanx.train.checkpoint.outputdir import prepare_output_dir, restart_note
from phalanx.train.checkpoint.rng import seed_everything
from phalanx.train.evaluation import EvalSetup, evaluate_model
from phalanx.train.flow import due_after_step, metric_key, record_evaluation
from phalanx.train.logging.runlog import emit
from phalanx.train.saving import CheckpointSaves
from phalanx.train.stopping import Stop, TrainingStopped
from phalanx.train.trainer_state import (
    ResumeWarning,
    TrainState,
    resume_warning,
)


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


class Trainer(CheckpointSaves):
    """Train `model` on `train_dataset` as `args` says; see docs/trainer.md.

    Its construction (joining the world, the model, the data, the callbacks) is
    `TrainerSetup`'s (trainer_setup.py), what Ray Train adds `ClusterRun`'s (cluster.py), its
    saves `CheckpointSaves`' (saving.py); the loop, logging and evaluation are here.
    """

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
        resumed_from: str | None = None
        if self._live is not None and self._live.is_replacement:
            self._join_run()
        else:
            started = self._start_run(resume_from_checkpoint)
            if isinstance(started, TrainOutput):
                return started
            resumed_from = started
        try:
            with self._stop_requests.installed(self.args.save_on_signal):
                self._loop()
                if self._live is not None:
                    self._live.finish()
                if self._stopped_by is not None:
                    raise self._stop_and_save(self._stopped_by)
                self._collect_save()
            self._load_best_model()
            self._callbacks.fire("on_train_end")
            self._callbacks.agree()
        except Exception:
            self._settle_save()  # a save in flight completes before the error leaves
            raise
        finally:
            self._report.close()
        return self._output(resumed_from)

    def _start_run(
        self, resume_from_checkpoint: bool | str | Path | None
    ) -> str | TrainOutput | None:
        """Everything before the loop: the output dir, the resume, the report, the callbacks'
        first event; the checkpoint resumed from, or the output when nothing is left to do."""
        resume = resume_from_checkpoint
        if resume is None:  # HF's field; "true" (any case) is True
            field = self.args.resume_from_checkpoint
            resume = False if field is None else (True if field.lower() == "true" else field)
        restart = restart_note()
        if restart is not None:
            self._report.say(f"{restart}: " + ("resuming…" if resume else "starting afresh"))
        with self._restored(resume_from_checkpoint, resume) as (resume, restored):
            prepare_output_dir(self.world, self.args, fresh=resume is False)
            seed_everything(self.args.seed)
            self.state = TrainState()
            self._make_entries()
            resumed_from = None if resume is False else self._resume(resume, restored)
        if self.state.global_step >= self.max_steps:
            self._rng.restore()
            self._report.say(f"already at max_steps ({self.max_steps}) — nothing to do")
            done = (self.state.global_step, self._mean_loss(), 0.0, 0.0, resumed_from)
            return TrainOutput(*done, self.world.launcher)
        keep_until = self.state.global_step if resumed_from is not None else 0
        with timelines.span_of(self.timeline, "open run (barrier)"):
            self._report.open(self.max_steps, self.state.global_step, keep_until)
        self._rng.restore()  # last, so nothing above can shift the dropout masks
        self._saved_step = self.state.global_step if self._resumed_here(resumed_from) else None
        self._callbacks.control._new_training()
        self._callbacks.fire("on_train_begin")
        self._callbacks.agree()
        return resumed_from

    def _join_run(self) -> None:
        """A replacement under live recovery: join, take a live peer's state, and go on where
        the others are (no output dir to prepare, no checkpoint to read, no barrier: the
        others are mid-run; the callbacks' on_train_begin was theirs)."""
        assert self._live is not None
        seed_everything(self.args.seed)
        self.state = TrainState()
        self._make_entries()
        self._live.join()
        self._saved_step = None
        self._callbacks.control._new_training()

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the model of the best evaluation's checkpoint, on every rank."""
        best = self.state.best_model_checkpoint
        if not self.args.load_best_model_at_end or best is None:
            return
        if self.state.best_global_step != self.state.global_step:  # else it is the model now
            self._checkpointer.load(Path(best), {"model": self.checkpoint_states()["model"]})
        self._report.say(
            f"loaded the best model: {Path(best).name} ({metric_key(self.args)} "
            f"{self.state.best_metric:.6g})"
        )

    def _resumed_here(self, resumed_from: str | None) -> bool:
        """Whether the checkpoint resumed from is output_dir's own: no need to write it again."""
        return resumed_from is not None and Path(resumed_from).parent == Path(self.args.output_dir)

    def _resume(self, resume_from: bool | str | Path, restored: Path | None = None) -> str | None:
        """`restored`: this node's copy of the checkpoint Ray restored (rank 0 chose its own)."""
        path = self._checkpointer.choose(resume_from)
        if path is None:
            self._report.say(f"no checkpoint in {self.args.output_dir} yet: starting at step 0")
            return None
        self._checkpointer.load(path if restored is None else restored, self.checkpoint_states())
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
        runlog = self._runlog or self.open_runlog()  # a replacement's opened at its join
        while not self._train_epoch():
            self.state.epoch += 1
            self.state.batches_done = 0
        if runlog.window.steps and self.args.logging_strategy != "no":
            self._log()

    def _train_epoch(self) -> bool:
        """Train the rest of this epoch; True when training ends in it (max_steps, or a stop).

        The stop is agreed before each step's data is loaded (a dataset that draws
        random numbers would otherwise have drawn them for a step never trained) and
        once after the last step, so a signal during it is honoured as well.
        """
        control = self._callbacks.control
        control._new_epoch()
        self._callbacks.fire("on_epoch_begin")
        with self.strategy.uneven_inputs(self.args.even_batches) as shadow:
            self._stepper.shadow = shadow
            steps = self._epoch_steps()
            while True:
                try:
                    if self._live is not None:
                        self._live.boundary()
                    if self._stop_agreed() or self.state.global_step >= self.max_steps:
                        return True
                    if control.should_training_stop:
                        return True
                    if control.should_epoch_stop:
                        return False
                    batches, expected = next(steps, ([], 0))
                    if shadow is None:  # none to shadow: a loader shorter than its len() ends
                        expected = len(batches)
                    if not expected:
                        return False
                    self._train_step(batches, expected)
                except PeerLost as lost:
                    if self._live is None:
                        raise
                    self._live.recover(lost)  # the step in flight is dropped on every member
                    steps = self._epoch_steps()

    def _stop_agreed(self) -> bool:
        """The boundary vote (stopping.py): a stop, and whether the save in flight is
        written on every rank, which is then collected here, at the same step everywhere."""
        self._stopped_by, written = self._stop_requests.agree(self._save_vote())
        if written:
            self._collect_save()
            self._callbacks.agree()  # what on_save asked for
        return self._stopped_by is not None

    def _epoch_steps(self) -> Iterator[tuple[list[Any], int]]:
        """This epoch's steps from the current position on: (this rank's micro-batches, how
        many the step has on the longest rank)."""
        if self.stream is not None:
            return self.stream.steps(self.state.epoch, self.args.gradient_accumulation_steps)
        assert self.sampler is not None
        self.sampler.set_epoch(self.state.epoch)
        if self._live is not None:  # the world may have changed: this epoch's length in it
            self.set_epoch_length(len(self.train_loader))
        self._loader_generator.manual_seed(self.args.seed + self.state.epoch)
        return step_groups(
            iter(self.train_loader),
            self.state.batches_done,
            self.args.gradient_accumulation_steps,
            self.micro_batches_per_epoch,
        )

    def _train_step(self, batches: list[Any], expected: int) -> None:
        self._callbacks.control._new_step()
        self._callbacks.fire("on_step_begin")
        result = self._stepper.run(batches, expected, self.loss_fn, self.state)
        self.state.batches_done += expected
        self.state.global_step += 1
        progress_record.step(self.state.global_step + 1)
        assert self._runlog is not None
        self._runlog.add(result)
        self._report.advance()
        self._callbacks.fire("on_step_end")
        self._after_step()

    def _after_step(self) -> None:
        """Between steps, on every rank alike: replica check, logging, evaluation, saving, as
        the strategies and the callbacks (agreed between ranks: flow.py) say."""
        step, args = self.state.global_step, self.args
        local = self.periodic_sync
        if local is not None and local.deferred:
            local.sync_if_due()  # live recovery: after the step counts (train/live.py)
        if local is not None and step == self.max_steps:
            local.sync()  # the run ends with one model (a no-op right after a sync)
        in_sync = local is None or local.in_sync  # the same on every rank
        if args.replica_check_steps and step % args.replica_check_steps == 0 and in_sync:
            check_replicas(self.wrapped_model, self.world.process_group)
        epoch_ended = self.state.batches_done >= self.micro_batches_per_epoch
        if epoch_ended:
            self._callbacks.fire("on_epoch_end")
        self._callbacks.agree()
        due = due_after_step(args, step, self.max_steps, epoch_ended, self._callbacks.control)
        if due.log:
            self._log()
        save = due.save
        if due.evaluate and (self.eval_dataset is not None or args.eval_strategy != "no"):
            best = record_evaluation(args, self.state, self.evaluate())
            save = save or (args.save_strategy == "best" and best)
        if save:
            self._save(background=self._saves_in_background())
        if due.log or due.evaluate or save:
            self._callbacks.agree()  # what on_log, on_evaluate and on_save asked for

    def _stop_and_save(self, stop: Stop) -> TrainingStopped:
        """Every rank agreed to stop: save at this step (unless done already) and say so, on
        the console and to the launcher, whose summary then names the rank signalled."""
        step = self.state.global_step
        path = Path(self.args.output_dir) / f"{PREFIX}{step}"
        self._collect_save()  # a save in flight is completed first
        if self._saved_step != step:
            path = self.save_checkpoint()
        stopped = TrainingStopped(stop.signum, step, path.name, stop.received_by)
        note = f"{stopped} — resume with resume_from_checkpoint=True"
        self._report.say(note)
        progress_record.note_stop(note)
        return stopped

    # ---------------------------------------------------------------- logging
    def _log(self) -> None:
        """One log line for the steps since the last (every rank calls this)."""
        assert self._runlog is not None
        state = self.state
        extra = {
            "lr": float(self.scheduler.get_last_lr()[0]),
            "epoch": self.epoch_progress(),
        }
        if self.args.on_nonfinite_grad == "skip":
            extra["skipped_steps"] = float(state.skipped_steps)
        self._callbacks.log(self._runlog.log(state.global_step, extra))

    def _mean_loss(self) -> float:
        steps = self.state.global_step - self.state.skipped_steps
        return self.state.loss_sum / steps if steps else math.nan

    def _output(self, resumed_from: str | None) -> TrainOutput:
        summary = self._sync_loss()
        self._runlog = None
        self._finish_on_cluster()
        return TrainOutput(
            global_step=self.state.global_step,
            train_loss=self._mean_loss(),
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
        self._callbacks.log(metrics)
        self._callbacks.fire("on_evaluate", metrics=metrics)
        return metrics

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The model alone, in Hugging Face's format, into `output_dir` (args.output_dir by
        default), as HF's Trainer.save_model; every rank must call it."""
        self._check_open()
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        sharded = self.strategy.sharded_model
        hf_save.save_model(self.model, self.world, out, self._tied, sharded)
        self._report.say(f"saved the model in Hugging Face's format to {out}")
        return out
