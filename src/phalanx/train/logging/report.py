"""What rank 0 shows and writes during a run: the progress bar, status lines, metric files.

Every method is called on every rank; only rank 0 has a bar and sinks. A
metric file that cannot be written (a full disk) is one `OutputError` on
every rank, naming the file and the system's reason, instead of an OSError
on rank 0 and "Connection closed by peer" on the others.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from phalanx.errors import ConfigurationError, OutputError
from phalanx.runtime import World
from phalanx.train.config.args import TrainingArguments
from phalanx.train.logging.metrics import MetricsSink, close_sinks, log_metrics, open_sinks
from phalanx.train.logging.progress_bar import Progress

logger = logging.getLogger("phalanx.train")


class RunReport:
    """Rank 0's console, progress bar and metric sinks for one train() call."""

    def __init__(self, world: World, args: TrainingArguments) -> None:
        self.world = world
        self.args = args
        self.progress: Progress | None = None
        self.sinks: list[MetricsSink] = []

    def open(self, total: int, initial: int, keep_until: int) -> None:
        """Collective: a bar from `initial` to `total`, and the sinks, with the metric files
        trimmed to steps up to `keep_until` (what the checkpoint resumed from covers)."""
        error: OutputError | ConfigurationError | None = None
        if self.world.is_main:
            self.progress = Progress(total, initial, self.args)
            try:
                self.sinks = open_sinks(
                    self.args.report_to,
                    Path(self.args.output_dir),
                    self._line,
                    keep_until,
                    self.args.to_dict(),
                )
            except (OutputError, ConfigurationError) as exc:
                error = exc
        self.world.barrier_or_raise(error)

    def close(self) -> None:
        close_sinks(self.sinks)
        if self.progress is not None:
            self.progress.close()
        self.sinks, self.progress = [], None

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance()

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        """Collective: rank 0 shows and writes `metrics`; a failed write fails every rank."""
        if self.progress is not None and "loss" in metrics:
            self.progress.show_loss(metrics["loss"])
        error: OutputError | None = None
        try:
            log_metrics(self.sinks, step, metrics)
        except OutputError as exc:
            error = exc
        self.world.barrier_or_raise(error)

    def say(self, text: str) -> None:
        """A status line on rank 0's console (resumed, saved, restarted)."""
        if self.world.is_main:
            self._line(text)

    def _line(self, text: str) -> None:
        """One line on the console, once: through logging where logging shows it (Ray
        Train's workers configure it, and so may a script), else through the bar. Both at
        once showed it twice; and Ray Train sends print to logging as well."""
        if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
            logger.info(text)
        elif self.progress is not None:
            self.progress.write(text)
        else:
            print(text, flush=True)


def human_size(count: int) -> str:
    """1234567 -> "1.2 MB"."""
    value = float(count)
    for unit in ("B", "kB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"
