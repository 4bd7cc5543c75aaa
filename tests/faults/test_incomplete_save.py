"""A save that never completed is said at the next start, naming its step (issue 36, item 5).

The writer was SIGKILLed inside the save of checkpoint-10 and the next run
swept the staging folder away in silence: nobody learned that step 10 was
never saved. Here a real process (tests/e2e/scripts/trainer_resume.py, one
rank, no launcher) kills itself after rank 0 wrote 3 files of checkpoint-10;
the resumed run must warn about checkpoint-10 and go on from checkpoint-5.
A replacement of a checkpoint cut between its two renames leaves the old copy
under a `.old` name and no checkpoint under the real one: it is put back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.train.checkpoint.directory import verify_checkpoint, write_checkpoint
from tests.launchkit import SCRIPTS, clean_env

pytestmark = pytest.mark.faults

SCRIPT = SCRIPTS / "trainer_resume.py"
RUN_TIMEOUT_S = 120


def _run(out: Path, *flags: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), str(out), str(out.with_suffix(".pt")), "--save-steps"]
    return subprocess.run(
        [*command, "5", *map(str, flags)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=clean_env(OMP_NUM_THREADS="1"),
        cwd=SCRIPTS,
    )


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_a_save_killed_midway_is_a_warning_at_the_next_start(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = _run(out, "--kill-in-save", "10:0:file3")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert [p.name for p in out.iterdir() if p.name.startswith("checkpoint-10")] != []
    resumed = _run(out, "--resume")
    printed = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, printed
    assert "IncompleteSaveWarning: checkpoint-10 was never completed" in printed, printed
    assert "resumed from checkpoint-5 " in printed, printed
    assert not [p for p in out.iterdir() if ".tmp" in p.name], sorted(os.listdir(out))


@pytest.mark.timeout(60)
def test_a_replacement_cut_between_its_renames_is_put_back(tmp_path: Path) -> None:
    from phalanx.train.checkpoint.outputdir import sweep_leftovers

    old = write_checkpoint(tmp_path, 4, {"model.pt": b"weights"})
    old.rename(tmp_path / "checkpoint-4.old")  # the first rename done, the second not
    notes = sweep_leftovers(tmp_path)
    assert len(notes) == 1 and "checkpoint-4 was being replaced" in notes[0], notes
    verify_checkpoint(tmp_path / "checkpoint-4")
