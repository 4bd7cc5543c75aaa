"""What a `train()` call logs: a window since the last log line, the whole call's
totals, and the bytes each step sent, whichever mechanism sent them.

Kept apart from the loop so the Trainer says *when* to log and this says *what*:
every number is reduced over ranks (every rank calls in at the same step), and
the communication counters come from DDP's reducer, ZeRO, stage 3 and local
SGD / DiLoCo alike, so `comm_bytes_per_step` means the same under every
strategy and sync_method.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.optim import Optimizer

from phalanx import zero3
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.stats import CommCounter
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.timeline import Timeline
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.runtime import World
from phalanx.train.logging.progress_bar import StepWindow
from phalanx.train.logging.report import RunReport
from phalanx.train.step import StepResult


class CommMeter:
    """This rank's communication so far, whatever sent it: DDP's reducer, ZeRO-1/2's
    parameter all-gathers, stage 3's units, a periodic sync."""

    def __init__(
        self,
        wrapped_model: nn.Module,
        periodic_sync: PeriodicSync | None,
        optimizer: Optimizer | None = None,
    ) -> None:
        self.ddp = wrapped_model if isinstance(wrapped_model, DistributedDataParallel) else None
        self.sharded = wrapped_model if zero3.unit_of(wrapped_model) is not None else None
        self.zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        self.periodic_sync = periodic_sync
        self._carried = (0, 0, 0.0)
        """(bytes, collectives, wait) of the meters this one took over from (continue_from)."""

    def continue_from(self, earlier: CommMeter) -> CommMeter:
        """Count on from `earlier`'s totals (live recovery wrapped the model again)."""
        (sent, calls), waited = earlier.sent(), earlier.wait_s()
        self._carried = (sent, calls, waited)
        return self

    def _counters(self) -> list[CommCounter]:
        counters = []
        if self.sharded is not None:
            counters.append(zero3.communication(self.sharded))
        if self.zero is not None:
            counters.append(self.zero.stats)
        return counters

    def wait_s(self) -> float:
        """Seconds the training thread waited for collectives: the reducer's end of backward,
        stage 3's gathers and reductions, ZeRO's parameter all-gathers."""
        waited = self.ddp.reducer.stats.comm_wait_s if self.ddp is not None else 0.0
        return self._carried[2] + waited + sum(c.wait_s for c in self._counters())

    def sent(self) -> tuple[int, int]:
        """(payload bytes, collectives) handed to collectives so far."""
        sent, calls, _ = self._carried
        if self.ddp is not None:
            sent, calls = self.ddp.reducer.stats.bytes_sent, self.ddp.reducer.stats.collectives
        for counter in self._counters():
            sent += counter.bytes_sent
            calls += counter.collectives
        if self.periodic_sync is not None:
            sent += self.periodic_sync.stats.sent_bytes
            calls += self.periodic_sync.stats.collectives
        return sent, calls


class RunLog:
    """The log window and the call's totals of one `train()` call."""

    def __init__(
        self, world: World, report: RunReport, comm: CommMeter, timeline: Timeline | None
    ) -> None:
        self.world, self.report, self.comm, self.timeline = world, report, comm, timeline
        self.run = StepWindow(comm.wait_s())
        """Everything since train() started, for its TrainOutput."""
        self.window = StepWindow(comm.wait_s())
        """Since the last log line."""
        self._sent_mark = comm.sent()

    def add(self, result: StepResult) -> None:
        for tracker in (self.run, self.window):
            tracker.add_samples(result.samples)
            if result.stepped:  # a skipped step's loss is not finite: it stays out of the mean
                tracker.add_step(result.loss, result.grad_norm)

    def log(self, step: int, extra: Mapping[str, float]) -> dict[str, float]:
        """Reduce the window over ranks (every rank calls this), log it on rank 0, reset it;
        what was logged (the same on every rank)."""
        window = self.window
        steps = max(1, window.steps)
        reduced = window.reduce(self.world, self.comm.wait_s())
        metrics = {k: v for k, v in reduced.items() if k not in ("last_loss", "window_s")}
        sent, calls = self.comm.sent()
        metrics["comm_bytes_per_step"] = (sent - self._sent_mark[0]) / steps
        metrics["collectives_per_step"] = (calls - self._sent_mark[1]) / steps
        self._sent_mark = (sent, calls)
        metrics.update(extra)
        emit(self.report, self.timeline, step, metrics)
        window.reset(self.comm.wait_s())
        return metrics

    def summary(self) -> dict[str, float]:
        """Collective: the whole call's loss, throughput and wall time."""
        return self.run.reduce(self.world, self.comm.wait_s())


def emit(
    report: RunReport, timeline: Timeline | None, step: int, metrics: dict[str, float]
) -> None:
    """One log line (rank 0) and the history file; a barrier, so timed on the timeline."""
    with timelines.span_of(timeline, "log (barrier)"):
        report.emit(step, metrics)
