"""What a `train()` call logs: a window since the last log line, the whole call's
totals, and the bytes each step sent, whichever mechanism sent them.

Kept apart from the loop so the Trainer says *when* to log and this says *what*:
every number is reduced over ranks (every rank calls in at the same step), and
the communication counters are one `Traffic` record that the run's strategy
sums from whatever sent it (DDP's reducer and its comm hook, ZeRO's gathers,
stage 3's units, local SGD / DiLoCo), so `comm_bytes_per_step` means the same
under every strategy and sync_method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.timeline import Timeline
from phalanx.parallel.traffic import Traffic
from phalanx.runtime import World
from phalanx.train.logging.progress_bar import StepWindow
from phalanx.train.logging.report import RunReport
from phalanx.train.step import StepResult

TrafficSource = Callable[[], Traffic]
"""This rank's traffic so far, whatever sent it (Strategy.traffic)."""


def continue_from(source: TrafficSource, earlier: Traffic) -> TrafficSource:
    """`source`, counted on from `earlier`, the total when live recovery wrapped the model
    again: the old wrapper's counters are gone with it, the others (a periodic sync's, the
    optimizer's) still count and are not carried twice."""
    carried = earlier - source()
    return lambda: carried + source()


class RunLog:
    """The log window and the call's totals of one `train()` call."""

    def __init__(
        self, world: World, report: RunReport, traffic: TrafficSource, timeline: Timeline | None
    ) -> None:
        self.world, self.report, self.traffic, self.timeline = world, report, traffic, timeline
        self._mark = traffic()
        """The traffic at the last log line."""
        self.run = StepWindow(self._mark.wait_s)
        """Everything since train() started, for its TrainOutput."""
        self.window = StepWindow(self._mark.wait_s)
        """Since the last log line."""
        self.loss_before = 0.0
        """The loss summed over the steps before `run` began (the state's loss_sum then)."""
        self.steps_before = 0
        """How many steps `loss_before` covers."""

    def loss_from(self, loss_sum: float, steps: int) -> None:
        """`run` counts on from `loss_sum` over `steps` steps."""
        self.loss_before, self.steps_before = loss_sum, steps

    def settle_loss(self, steps: int) -> tuple[float, dict[str, float]]:
        """Collective: the loss summed over `steps` steps (the run's mean for those since
        `steps_before`), and the run's summary."""
        summary = self.summary()
        mean = summary.get("loss", 0.0)
        return self.loss_before + mean * (steps - self.steps_before), summary

    def add(self, result: StepResult) -> None:
        for tracker in (self.run, self.window):
            tracker.add_samples(result.samples)
            tracker.add_time(result.seconds)
            if result.stepped:  # a skipped step's loss is not finite: it stays out of the mean
                tracker.add_step(result.loss, result.grad_norm)

    def log(self, step: int, extra: Mapping[str, float]) -> dict[str, float]:
        """Reduce the window over ranks (every rank calls this), log it on rank 0, reset it;
        what was logged (the same on every rank)."""
        window = self.window
        steps = max(1, window.steps)
        now = self.traffic()
        reduced = window.reduce(self.world, now.wait_s)
        metrics = {k: v for k, v in reduced.items() if k not in ("last_loss", "window_s")}
        sent = now - self._mark
        metrics["comm_bytes_per_step"] = sent.bytes_sent / steps
        metrics["comm_wire_bytes_per_step"] = sent.wire_bytes / steps
        metrics["collectives_per_step"] = sent.collectives / steps
        self._mark = now
        metrics.update(extra)
        emit(self.report, self.timeline, step, metrics)
        window.reset(self.traffic().wait_s)
        return metrics

    def summary(self) -> dict[str, float]:
        """Collective: the whole call's loss, throughput and wall time."""
        return self.run.reduce(self.world, self.traffic().wait_s)


def emit(
    report: RunReport, timeline: Timeline | None, step: int, metrics: dict[str, float]
) -> None:
    """One log line (rank 0) and the history file; a barrier, so timed on the timeline."""
    with timelines.span_of(timeline, "log (barrier)"):
        report.emit(step, metrics)
