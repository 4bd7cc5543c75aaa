"""What a cluster's launcher adds to a Trainer run; today Ray Train's (docs/ray.md).

Under Ray Train (`World.launcher == "ray"`: raytrain.py finds the session) the
Trainer resumes from the checkpoint Ray restored, reports each checkpoint it seals
and its metrics, reports the metrics the run ended with, and writes its timeline
when `train()` ends, since Ray's workers never exit normally and the exit hook
that writes it would never run. Under any other launcher every method here does
nothing. The loop calls three of them: `_restored` as a run starts,
`_checkpoint_done` once a checkpoint is sealed, `_finish_on_cluster` as `train()`
returns.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path

from phalanx.diagnostics import timeline as timelines
from phalanx.train.raytrain import RaySession, ray_session
from phalanx.train.trainer_setup import TrainerSetup

Resume = bool | str | Path


class ClusterRun(TrainerSetup):
    """The Trainer's side of a cluster's launcher (the loop is trainer.py's)."""

    _loss_mark: tuple[float, int] = (0.0, 0)
    """(loss summed, steps counted) at the last report to the cluster."""

    @functools.cached_property
    def _ray(self) -> RaySession | None:
        """This rank's Ray Train session, or None outside Ray Train."""
        return ray_session(self.world)

    @contextlib.contextmanager
    def _restored(
        self, asked: Resume | None, resume: Resume
    ) -> Iterator[tuple[Resume, Path | None]]:
        """What the run resumes from (`resume`, or Ray's checkpoint), and this node's copy of
        Ray's checkpoint while the block loads it; says which, and why.

        Under Ray Train a restart after a failure calls the function again: with
        resume_from_checkpoint True, or left unset, the run goes on from what Ray kept of
        its last report. False or a path is the user's word and is kept.
        """
        session = self._ray
        unset = asked is None and self.args.resume_from_checkpoint is None
        if session is None or not (unset or resume is True):
            yield resume, None
        else:
            why = (
                "resume_from_checkpoint=True" if resume is True else "resume_from_checkpoint unset"
            )
            with session.restored() as restored:
                if restored is None:
                    then = "the newest in output_dir, if any" if resume is True else "step 0"
                    self._report.say(
                        f"Ray Train run (launcher ray): Ray restored no checkpoint "
                        f"(ray.train.get_checkpoint() is None; {why}): starting from {then}"
                    )
                    yield resume, None
                else:
                    self._report.say(
                        f"Ray Train run (launcher ray): resuming from {restored.name}, the "
                        f"checkpoint Ray restored (ray.train.get_checkpoint(); {why}: a restart "
                        "goes on from Ray's last checkpoint)"
                    )
                    yield restored, restored
        self._loss_mark = (self.state.loss_sum, self.counted_steps())

    def _checkpoint_done(self, path: Path) -> None:
        """A checkpoint is sealed (renamed into place) on every rank's watch: report it."""
        if self._ray is not None:
            self._ray.report(self._cluster_metrics(path.name), self.state.global_step, path)

    def _finish_on_cluster(self) -> None:
        """train() returns (every rank, the loss settled): the last metrics, the timeline."""
        session = self._ray
        if session is None:
            return
        if session.reported_step != self.state.global_step:
            session.report(self._cluster_metrics(None), self.state.global_step, None)
        if self.timeline is not None:
            self.timeline.write()
            self.world.barrier_or_raise(None)  # every rank's file is complete
            if self.world.is_main:
                timelines.merge(self.timeline.path, self.world.world_size)

    def _cluster_metrics(self, checkpoint: str | None) -> dict[str, float | str]:
        """The step, the epoch, the mean loss since the last report ("loss") and over the
        whole run ("train_loss"), and the checkpoint's name: the same on every rank."""
        counted, total = self.counted_steps(), self.state.loss_sum
        before, before_steps = self._loss_mark
        run_mean = total / counted if counted else math.nan
        since = (total - before) / (counted - before_steps) if counted > before_steps else run_mean
        self._loss_mark = (total, counted)
        metrics: dict[str, float | str] = {
            "step": self.state.global_step,
            "epoch": self.epoch_progress(),
            "loss": since,
            "train_loss": run_mean,
        }
        if checkpoint is not None:
            metrics["checkpoint"] = checkpoint
        return metrics
