"""What issue 41's Ray trial found, on one process: a status line said once where logging
is configured, step_time_s without the time between steps, and a setting that cannot
apply warned about once (rank 0) instead of dropped without a word."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.ground.ports import free_port
from phalanx.runtime import SettingIgnoredWarning
from phalanx.train.config.args import TrainingArguments
from phalanx.train.logging.progress_bar import StepWindow
from phalanx.train.logging.report import RunReport
from phalanx.train.stopping import StopRequests


class OneRank:
    """A world of one, for what only sums over ranks (the sums are the values)."""

    world_size, rank, is_main = 1, 0, True

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)


@pytest.fixture
def configured_logging() -> Iterator[list[logging.LogRecord]]:
    """What Ray Train does on its workers (and a script's basicConfig): INFO to a handler."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_a_status_line_is_said_once_where_logging_shows_it(
    configured_logging: list[logging.LogRecord], capsys: pytest.CaptureFixture[str]
) -> None:
    report = RunReport(OneRank(), TrainingArguments(disable_tqdm=True))  # type: ignore[arg-type]
    report.say("saved checkpoint-4 (1 kB, 0.01 s)")
    said = [r.getMessage() for r in configured_logging]
    assert said == ["saved checkpoint-4 (1 kB, 0.01 s)"]
    assert capsys.readouterr().out == ""  # not printed as well


def test_without_logging_it_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    report = RunReport(OneRank(), TrainingArguments(disable_tqdm=True))  # type: ignore[arg-type]
    report.say("saved checkpoint-4")
    assert capsys.readouterr().out == "saved checkpoint-4\n"


def test_step_time_is_the_steps_own() -> None:
    """Two steps of 0.25 s each inside a window of any length: 0.25 s a step, whatever ran
    between them (a callback reporting to Ray, a save)."""
    window = StepWindow(0.0)
    for _ in range(2):
        window.add_samples(4)
        window.add_time(0.25)
        window.add_step(torch.tensor(1.0), None)
    assert window.reduce(OneRank(), 0.0)["step_time_s"] == 0.25  # type: ignore[arg-type]


def test_save_on_signal_off_the_main_thread_is_warned_once() -> None:
    stops = StopRequests(SimpleNamespace(rank=0, world_size=1))  # type: ignore[arg-type]
    caught: list[Any] = []

    def run() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with stops.installed(True):
                pass
            with stops.installed(False):
                pass
        caught.extend(seen)

    thread = threading.Thread(target=run, name="TrainingThread")
    thread.start()
    thread.join(timeout=30)
    assert [w.category for w in caught] == [SettingIgnoredWarning]
    assert "save_on_signal cannot catch SIGTERM" in str(caught[0].message)
    assert "(TrainingThread)" in str(caught[0].message)


@pytest.mark.timeout(60)
def test_a_timeout_or_backend_an_existing_group_cannot_take_is_warned() -> None:
    """Ray Train makes the group (TorchConfig's timeout) before the function runs."""
    os.environ.pop("RANK", None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=77),
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        phalanx.init(timeout=77)  # the group's own: nothing to say
        phalanx.init()  # nothing asked
        assert seen == []
        phalanx.init(timeout=60, backend="nccl")
    said = [str(w.message) for w in seen if w.category is SettingIgnoredWarning]
    assert len(said) == 2, said
    assert said[0].startswith("backend 'nccl' cannot apply: the process group exists already")
    assert said[1].startswith(
        "timeout 60 s cannot apply: the process group exists already with 77 s"
    )
