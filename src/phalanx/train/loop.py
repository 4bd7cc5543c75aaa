"""The steps of one `train()` call, top to bottom: epochs, the vote at each step boundary,
one optimizer step, and what is due between steps.

The order is the contract every rank keeps: whatever is a collective (the stop
vote, the callbacks' agreement, logging, evaluation, a save) runs on every rank
at the same step, in the same order, so the branches below are taken alike
everywhere. The Trainer (trainer.py) owns this object and gives it its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from phalanx.diagnostics.replicas import check_replicas
from phalanx.errors import PeerLost
from phalanx.ground import progress_record
from phalanx.train.batches import step_groups
from phalanx.train.checkpoint.directory import PREFIX
from phalanx.train.config.args import TrainingArguments
from phalanx.train.flow import due_after_step, record_evaluation
from phalanx.train.saving import CheckpointSaves
from phalanx.train.stopping import Stop, TrainingStopped
from phalanx.train.trainer_setup import TrainerSetup
from phalanx.train.trainer_state import TrainState

__all__ = ["TrainingLoop"]


class TrainingLoop:
    """The loop over a Trainer's parts; `evaluate` and `save(background)` are the Trainer's."""

    def __init__(
        self,
        setup: TrainerSetup,
        saves: CheckpointSaves,
        evaluate: Callable[[], dict[str, float]],
        save: Callable[[bool], Path],
    ) -> None:
        self.setup, self.saves = setup, saves
        self._evaluate, self._save = evaluate, save
        self._callbacks, self._report = setup.callbacks, setup.report
        self.stopped_by: Stop | None = None
        """The signal the ranks agreed to stop for (train() then saves and exits)."""

    @property
    def state(self) -> TrainState:
        return self.setup.state

    @property
    def args(self) -> TrainingArguments:
        return self.setup.args

    def run(self) -> Stop | None:
        """Train until max_steps, or until the ranks agree to stop at a step boundary (the
        stop they agreed on, which `stop_and_save` then ends with)."""
        runlog = self.setup.runlog or self.setup.open_runlog()  # a replacement's: its join
        while not self._train_epoch():
            self.state.epoch += 1
            self.state.batches_done = 0
        if runlog.window.steps and self.args.logging_strategy != "no":
            self._log()
        return self.stopped_by

    def _train_epoch(self) -> bool:
        """Train the rest of this epoch; True when training ends in it (max_steps, or a stop)."""
        setup, control = self.setup, self._callbacks.control
        control._new_epoch()
        self._callbacks.fire("on_epoch_begin")
        with self.setup.strategy.uneven_inputs(self.args.even_batches) as shadow:
            setup.stepper.shadow = shadow
            steps = self._epoch_steps()
            while True:
                try:
                    # A peer lost is seen here first; a replacement waiting is agreed on in
                    # the boundary vote, so every member leaves for it here together.
                    grow = None if setup.live is None else setup.live.boundary()
                    # Agreed before the step's data is loaded: a dataset that draws random
                    # numbers would otherwise draw them for a step never trained.
                    if self._stop_agreed(grow) or self.state.global_step >= setup.max_steps:
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
                    if setup.live is None:
                        raise
                    self.saves.settle()  # a save in flight ends with its generation
                    setup.live.recover(lost)  # the step in flight is dropped on every member
                    steps = self._epoch_steps()

    def _stop_agreed(self, grow: bool | None = None) -> bool:
        """The boundary vote (stopping.py): a stop, and whether the save in flight is
        written on every rank, which is then collected here, at the same step everywhere;
        under live recovery, whether a replacement is let in here (PeerLost, on every
        member). A stop wins: a run that ends lets nobody in."""
        self.stopped_by, written, grown = self.setup.stop_requests.agree(self.saves.vote(), grow)
        if written:
            self.saves.collect()
            self._callbacks.agree()  # what on_save asked for
        if grown and self.stopped_by is None and self.setup.live is not None:
            self.setup.live.grow()
        return self.stopped_by is not None

    def _epoch_steps(self) -> Iterator[tuple[list[Any], int]]:
        """This epoch's steps from the current position on: (this rank's micro-batches, how
        many the step has on the longest rank)."""
        setup, state, args = self.setup, self.state, self.args
        if setup.stream is not None:
            return setup.stream.steps(state.epoch, args.gradient_accumulation_steps)
        assert setup.sampler is not None
        setup.sampler.set_epoch(state.epoch)
        if setup.live is not None:  # the world may have changed: this epoch's length in it
            setup.set_epoch_length(len(setup.train_loader))
        setup.loader_generator.manual_seed(args.seed + state.epoch)
        return step_groups(
            iter(setup.train_loader),
            state.batches_done,
            args.gradient_accumulation_steps,
            setup.micro_batches_per_epoch,
        )

    def _train_step(self, batches: list[Any], expected: int) -> None:
        """One optimizer step over `batches`, then what is due between steps."""
        setup, state = self.setup, self.state
        self._callbacks.control._new_step()
        self._callbacks.fire("on_step_begin")
        # Begun, the first step too: a loss from here is one the others can go on from (the
        # boundary vote before it had every member), not one before anything trained
        # (launch/live.py reads it to choose a replacement over restarting the group).
        progress_record.step(state.global_step + 1)
        result = setup.stepper.run(batches, expected, setup.loss_fn, state)
        state.batches_done += expected
        state.global_step += 1
        progress_record.step(state.global_step + 1)  # the launcher's hang watch: step begun
        assert setup.runlog is not None
        setup.runlog.add(result)
        self._report.advance()
        self._callbacks.fire("on_step_end")
        self._after_step()

    def _after_step(self) -> None:
        """Between steps, on every rank alike: local sync, replica check, logging,
        evaluation, saving, as the strategies and the callbacks (agreed: flow.py) say."""
        setup, step, args = self.setup, self.state.global_step, self.args
        local = setup.periodic_sync
        if local is not None and local.deferred:
            local.sync_if_due()  # live recovery: after the step counts (train/live.py)
        if local is not None and step == setup.max_steps:
            local.sync()  # the run ends with one model (a no-op right after a sync)
        in_sync = local is None or local.in_sync  # the same on every rank
        if args.replica_check_steps and step % args.replica_check_steps == 0 and in_sync:
            check_replicas(setup.wrapped_model, self.setup.world.process_group)
        epoch_ended = self.state.batches_done >= setup.micro_batches_per_epoch
        if epoch_ended:
            self._callbacks.fire("on_epoch_end")
        # The callbacks' control is agreed before it steers the log, evaluation and save:
        # every rank must take the same branches below, which are collectives.
        self._callbacks.agree()
        due = due_after_step(args, step, setup.max_steps, epoch_ended, self._callbacks.control)
        if due.log:
            self._log()
        save = due.save
        if due.evaluate and (setup.eval_dataset is not None or args.eval_strategy != "no"):
            best = record_evaluation(args, self.state, self._evaluate())
            save = save or (args.save_strategy == "best" and best)  # after its evaluation
        if save:
            self._save(self.saves.in_background(setup.checkpoint_states()))
        if due.log or due.evaluate or save:
            self._callbacks.agree()  # what on_log, on_evaluate and on_save asked for

    def stop_and_save(self, stop: Stop) -> TrainingStopped:
        """Every rank agreed to stop: save at this step (unless done already) and say so, on
        the console and to the launcher, whose summary then names the rank signalled."""
        step = self.state.global_step
        path = Path(self.args.output_dir) / f"{PREFIX}{step}"
        self.saves.collect()  # a save in flight is completed first
        if self.saves.saved_step != step:
            path = self._save(False)
        stopped = TrainingStopped(stop.signum, step, path.name, stop.received_by)
        note = f"{stopped} — resume with resume_from_checkpoint=True"
        self._report.say(note)
        progress_record.note_stop(note)
        return stopped

    def _log(self) -> None:
        """One log line for the steps since the last (every rank calls this)."""
        runlog, state = self.setup.runlog, self.state
        assert runlog is not None
        extra = {
            "lr": float(self.setup.scheduler.get_last_lr()[0]),
            "epoch": self.setup.epoch_progress(),
        }
        if self.args.on_nonfinite_grad == "skip":
            extra["skipped_steps"] = float(state.skipped_steps)
        self._callbacks.log(runlog.log(state.global_step, extra))
