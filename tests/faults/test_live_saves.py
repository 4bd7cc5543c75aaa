"""Background saves under live recovery: a checkpoint written while the loss of a member
(SIGKILL) or its stall (SIGSTOP) ends the generation fails at once instead of waiting on a
member that will not answer; the survivors say so, go on, and the next save writes again.
The survivors wait for their own writer to reach that collective (its current file
written) before they recover, so that nothing of the dropped save is still being written
once the run goes on.

tests/faults/scripts/live_trainer.py with SLOW_WRITE_S: each background write waits 3 s
before it writes, so the save of step 10 is in flight when r1 goes in step 12.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.train.checkpoint.directory import verify_checkpoint
from tests.faults.test_live_trainer import _check_epochs, _train

pytestmark = pytest.mark.faults


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGKILL", pytest.param("SIGSTOP", marks=pytest.mark.slow)])
def test_a_save_in_flight_when_a_member_goes_is_dropped_and_the_run_goes_on(
    tmp_path: Path, how: str
) -> None:
    run = tmp_path / "run"
    out = _train(run, tmp_path / "ledger", 70, SAVE_STEPS="10", SLOW_WRITE_S="3",
                 KILL_MEMBER="r1", KILL_STEP="12", KILL_SIGNAL=how, HOLD_STEP="14",
                 HOLD_WORLD="3")  # fmt: skip
    said = [line for line in out.splitlines() if "[rank 0]" in line]
    dropped = [line for line in said if "the save in flight did not complete" in line]
    assert len(dropped) == 1 and "generation 0 ended" in dropped[0], out
    assert "saved checkpoint-10" not in out and "saved checkpoint-70" in out, out
    worlds = _check_epochs(tmp_path / "ledger", 70)
    # The survivors finish their part of the write before they recover (it reaches its next
    # collective, which fails): here the 3 s sleep, long enough for the replacement to
    # be waiting already, so it joins at once and every step runs at 3.
    assert worlds[:11] == [3] * 11 and worlds[-1] == 3 and "live recovery: " in out, worlds
    names = {p.name for p in run.iterdir() if p.name.startswith("checkpoint-")}
    assert names == {f"checkpoint-{s}" for s in range(20, 71, 10)}, names  # no .tmp left
    verify_checkpoint(run / "checkpoint-70")
