"""Where logged metrics go: the console, metrics.jsonl, metrics.csv, TensorBoard, and the
trackers (W&B, MLflow: trackers.py).

Only rank 0 makes sinks; the numbers it logs are already reduced over ranks.
The files are appended to, line by line and flushed, so a killed run keeps
everything it logged; on resume `forget_after(step)` drops the lines the
killed run wrote past its last checkpoint, so each step appears once.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol, get_args

from phalanx.errors import ConfigurationError, OutputError
from phalanx.ground.safe_files import create_file, open_append, open_regular
from phalanx.train.checkpoint.directory import describe_os_error
from phalanx.train.logging.trackers import MlflowSink, WandbSink, rewrite_logs

Reporter = Literal["console", "jsonl", "csv", "tensorboard", "wandb", "mlflow"]
"""The one list of sinks: TrainingArguments.report_to takes its item type from it, and
mypy checks that `make_sink` builds each."""
REPORTERS: tuple[Reporter, ...] = get_args(Reporter)

JSONL_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"
_CSV_HEADER = ["step", "metric", "value"]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _format(name: str, value: float) -> str:
    if name in ("lr", "learning_rate"):
        return f"{name} {value:.3e}"
    if name.endswith("samples"):
        return f"{name} {value:g}"
    if name == "epoch":
        return f"{name} {value:.2f}"
    return f"{name} {value:.4g}"


class ConsoleSink:
    """One line per log: `step 40 | loss 0.3132 | lr 1.000e-03 | ...`."""

    def __init__(self, write: Callable[[str], None] = print) -> None:
        self.write = write

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.write(" | ".join([f"step {step}", *(_format(k, v) for k, v in metrics.items())]))

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per log, `{"step": ..., "loss": ...}`, for scripts and plots."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_append(path)  # a link planted as metrics.jsonl is refused

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CsvSink:
    """Long format, `step,metric,value`: training and evaluation rows share one header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_append(path)
        fresh = os.fstat(self._file.fileno()).st_size == 0
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(_CSV_HEADER)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._writer.writerows([step, name, repr(value)] for name, value in metrics.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in rewrite_logs(metrics).items():  # HF's train/ and eval/ names
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def make_sinks(
    report_to: list[Reporter],
    output_dir: Path,
    write: Callable[[str], None] = print,
    config: Mapping[str, Any] | None = None,
) -> list[MetricsSink]:
    """The sinks `report_to` names; `config` (the arguments) is what trackers record."""
    try:
        return [make_sink(name, output_dir, write, config or {}) for name in report_to]
    except OSError as exc:
        raise _write_failed(exc, output_dir) from exc


def open_sinks(
    report_to: list[Reporter],
    output_dir: Path,
    write: Callable[[str], None],
    keep_until: int,
    config: Mapping[str, Any] | None = None,
) -> list[MetricsSink]:
    """Trim the metric files to steps <= keep_until (see forget_after), then make the sinks."""
    try:
        forget_after(output_dir, keep_until)
    except OSError as exc:
        raise _write_failed(exc, output_dir) from exc
    return make_sinks(report_to, output_dir, write, config)


def log_metrics(sinks: list[MetricsSink], step: int, metrics: Mapping[str, float]) -> None:
    """Give `metrics` to every sink; a failed write is an OutputError naming the file and why."""
    for sink in sinks:
        try:
            sink.log(step, metrics)
        except OSError as exc:
            raise _write_failed(exc, getattr(sink, "path", None)) from exc


def close_sinks(sinks: list[MetricsSink]) -> None:
    """Close every sink; one that already failed (a full disk) may fail again, quietly."""
    for sink in sinks:
        with contextlib.suppress(OSError):
            sink.close()


def _write_failed(exc: OSError, path: Path | None) -> OutputError:
    fix = (
        "remove the link (metric files are written in output_dir itself)"
        if exc.errno == errno.ELOOP
        else "free space, or fix the permissions of output_dir"
    )
    return OutputError(
        f"could not write {describe_os_error(exc, path)} — {fix}; the checkpoints written "
        "so far are intact"
    )


def make_sink(
    name: Reporter, output_dir: Path, write: Callable[[str], None], config: Mapping[str, Any]
) -> MetricsSink:
    if name == "console":
        return ConsoleSink(write)
    if name == "jsonl":
        return JsonlSink(output_dir / JSONL_NAME)
    if name == "csv":
        return CsvSink(output_dir / CSV_NAME)
    if name == "tensorboard":
        return TensorBoardSink(output_dir / TENSORBOARD_DIR)
    run_name = str(config.get("run_name") or Path(output_dir).resolve().name)
    if name == "wandb":
        return WandbSink(output_dir, config, run_name)
    if name == "mlflow":
        return MlflowSink(output_dir, config, run_name)
    return _unknown(name)


def _unknown(name: NoReturn) -> NoReturn:
    # mypy accepts the call in make_sink only while every Reporter has a branch.
    raise ConfigurationError(
        f"report_to names {name!r}, which phalanx does not know — use any of {list(REPORTERS)}"
    )


def _rewrite_keeping(path: Path, keep: Callable[[str], bool]) -> None:
    """Rewrite `path` with only the lines `keep` accepts, atomically: through a new file
    of a random name (O_EXCL|O_NOFOLLOW), renamed over it. A link at `path` is refused."""
    try:
        with open_regular(path) as file:
            lines = file.read().decode("utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return
    kept = [line for line in lines if keep(line)]
    if len(kept) == len(lines):
        return
    partial, file = create_file(path.parent, path.name, ".partial")
    try:
        with file:
            file.write("".join(kept).encode("utf-8"))
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _step_of_json(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _step_of_csv(line: str) -> int | None:
    head = line.split(",", 1)[0]
    return int(head) if head.isdigit() else None


def forget_after(output_dir: Path, step: int) -> None:
    """Drop metric lines past `step` (a resumed run logs those steps again) and torn lines."""

    def keep_json(line: str) -> bool:
        found = _step_of_json(line)
        return found is not None and found <= step

    def keep_csv(line: str) -> bool:
        if line.startswith(_CSV_HEADER[0] + ","):
            return True
        found = _step_of_csv(line)
        return found is not None and found <= step and line.endswith("\n")

    _rewrite_keeping(output_dir / JSONL_NAME, keep_json)
    _rewrite_keeping(output_dir / CSV_NAME, keep_csv)
