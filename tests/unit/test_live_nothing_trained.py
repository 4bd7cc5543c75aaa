"""A first worker lost before anything trained restarts the group (launch/live.py:
`_nothing_trained`), decided from the workers' progress records, not from the survivors'
mark, which under load came after the launcher had started a replacement (a
test_live_setup_loss run said "replacement j1 starting", then restarted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.ground.progress_record import PROGRESS_DIR_VAR
from phalanx.launch.live import LiveSupervisor

_WRITE = """
import sys
from phalanx.ground import progress_record as p
p.start(int(sys.argv[1]), 3, 600.0)
if sys.argv[2] == "step":
    p.step(1)
elif sys.argv[2] == "collective":
    p.collective("ddp all_reduce", 0, 1)
"""


def _records(directory: Path, what: list[str]) -> None:
    """Each rank's record as a real worker leaves it: opened, then perhaps a step begun or
    a collective entered."""
    for rank, done in enumerate(what):
        env = {PROGRESS_DIR_VAR: str(directory), "PATH": "/usr/bin:/bin"}
        subprocess.run([sys.executable, "-c", _WRITE, str(rank), done], env=env, check=True,
                       timeout=60)  # fmt: skip


def _supervisor(directory: Path, members: list[str] | None = None) -> Any:
    supervisor: Any = LiveSupervisor.__new__(LiveSupervisor)
    supervisor.progress_dir, supervisor.members = directory, members or []
    supervisor._slots = [
        SimpleNamespace(worker=SimpleNamespace(rank=r), member=f"r{r}") for r in range(3)
    ]
    return supervisor


@pytest.mark.parametrize(
    ("what", "restarts"),
    [(["none", "none", "none"], True), (["none", "step", "none"], False),
     (["collective", "none", "none"], False)],
    ids=["nothing", "a-step-begun", "a-collective-entered"],
)  # fmt: skip
def test_a_first_worker_lost_before_anything_trained_restarts_the_group(
    tmp_path: Path, what: list[str], restarts: bool
) -> None:
    _records(tmp_path, what)
    supervisor = _supervisor(tmp_path)
    assert supervisor._nothing_trained(supervisor._slots[1]) is restarts


def test_not_for_a_replacement_nor_without_records(tmp_path: Path) -> None:
    _records(tmp_path, ["none", "none", "none"])
    supervisor = _supervisor(tmp_path)
    late = SimpleNamespace(worker=SimpleNamespace(rank=1), member="j1")
    assert not supervisor._nothing_trained(late)  # the run it was to join goes on
    assert not _supervisor(tmp_path / "empty")._nothing_trained(supervisor._slots[1])
