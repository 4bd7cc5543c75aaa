"""What a cluster's launcher adds to a Trainer run; today Ray Train's (docs/ray.md).

Under Ray Train (`World.launcher == "ray"`: raytrain.py finds the session) the
Trainer resumes from the checkpoint Ray restored, reports each checkpoint it seals
and its metrics, reports the metrics the run ended with, and writes its timeline
when `train()` ends, since Ray's workers never exit normally and the exit hook
that writes it would never run. Under any other launcher every method here does
nothing. The Trainer calls three of them: `restored` as a run starts,
`checkpoint_sealed` once a checkpoint is sealed (through its saves), `finish` as
`train()` returns.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path

from phalanx.diagnostics.trace import merge
from phalanx.train.logging.report import RunReport
from phalanx.train.raytrain import RaySession, ray_session
from phalanx.train.trainer_setup import TrainerSetup

Resume = bool | str | Path


class ClusterReport:
    """The Trainer's side of a cluster's launcher: what it resumes from, and what it reports.

    It reads the run's progress (the step, the loss, the epoch) from `setup` when it
    reports, and keeps one thing of its own: the loss at its last report.
    """

    def __init__(self, setup: TrainerSetup, report: RunReport) -> None:
        self.setup = setup
        """The Trainer's parts: the world, the state and the timeline, read when reporting."""
        self.report = report
        self.loss_mark: tuple[float, int] = (0.0, 0)
        """(loss summed, steps counted) at the last report to the cluster."""

    @functools.cached_property
    def session(self) -> RaySession | None:
        """This rank's Ray Train session, or None outside Ray Train (found at first use, so
        a Trainer that never trains never imports ray)."""
        return ray_session(self.setup.world)

    @contextlib.contextmanager
    def restored(
        self, asked: Resume | None, resume: Resume
    ) -> Iterator[tuple[Resume, Path | None]]:
        """What the run resumes from (`resume`, or Ray's checkpoint), and this node's copy of
        Ray's checkpoint while the block loads it; says which, and why.

        Under Ray Train a restart after a failure calls the function again: with
        resume_from_checkpoint True, or left unset, the run goes on from what Ray kept of
        its last report. False or a path is the user's word and is kept.
        """
        session, setup = self.session, self.setup
        unset = asked is None and setup.args.resume_from_checkpoint is None
        if session is None or not (unset or resume is True):
            yield resume, None
        else:
            why = (
                "resume_from_checkpoint=True" if resume is True else "resume_from_checkpoint unset"
            )
            with session.restored() as restored:
                if restored is None:
                    then = "the newest in output_dir, if any" if resume is True else "step 0"
                    self.report.say(
                        f"Ray Train run (launcher ray): Ray restored no checkpoint "
                        f"(ray.train.get_checkpoint() is None; {why}): starting from {then}"
                    )
                    yield resume, None
                else:
                    self.report.say(
                        f"Ray Train run (launcher ray): resuming from {restored.name}, the "
                        f"checkpoint Ray restored (ray.train.get_checkpoint(); {why}: a restart "
                        "goes on from Ray's last checkpoint)"
                    )
                    yield restored, restored
        self.loss_mark = (setup.state.loss_sum, setup.counted_steps())

    def checkpoint_sealed(self, path: Path) -> None:
        """A checkpoint is sealed (renamed into place) on every rank's watch: report it."""
        if self.session is not None:
            self.session.report(self._metrics(path.name), self.setup.state.global_step, path)

    def finish(self) -> None:
        """train() returns (every rank, the loss settled): the last metrics, the timeline."""
        session, setup = self.session, self.setup
        if session is None:
            return
        if session.reported_step != setup.state.global_step:
            session.report(self._metrics(None), setup.state.global_step, None)
        if setup.timeline is not None:
            setup.timeline.write()
            setup.world.barrier_or_raise(None)  # every rank's file is complete
            if setup.world.is_main:
                merge(setup.timeline.path, setup.world.world_size)

    def _metrics(self, checkpoint: str | None) -> dict[str, float | str]:
        """The step, the epoch, the mean loss since the last report ("loss") and over the
        whole run ("train_loss"), and the checkpoint's name: the same on every rank."""
        state = self.setup.state
        counted, total = self.setup.counted_steps(), state.loss_sum
        before, before_steps = self.loss_mark
        run_mean = total / counted if counted else math.nan
        since = (total - before) / (counted - before_steps) if counted > before_steps else run_mean
        self.loss_mark = (total, counted)
        metrics: dict[str, float | str] = {
            "step": state.global_step,
            "epoch": self.setup.epoch_progress(),
            "loss": since,
            "train_loss": run_mean,
        }
        if checkpoint is not None:
            metrics["checkpoint"] = checkpoint
        return metrics
