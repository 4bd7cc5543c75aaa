"""Live recovery with a member lost before the first step (issue 38): before its group has
formed (the others would wait inside that formation until the run's timeout: a silent hang
of 30 minutes), once its Trainer is built, or as train() begins. Nothing has trained, and
the others have nothing to go on from that a fresh start would not give: the launcher
restarts the worker group (--max-restarts), says why, and the run ends as an undisturbed
one does.

tests/faults/scripts/live_trainer.py with DIE_IN_SETUP=r1:<where>, in the first attempt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.test_live_trainer import _fit, _train

pytestmark = pytest.mark.faults


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("where", "stage"),
    [("init", "0"), ("train", "0"), pytest.param("built", "0", marks=pytest.mark.slow),
     pytest.param("init", "3", marks=pytest.mark.slow),
     pytest.param("train", "3", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_member_lost_before_the_first_step_restarts_the_group(
    tmp_path: Path, where: str, stage: str
) -> None:
    quiet = _train(tmp_path / "quiet", tmp_path / "ql", 20, ZERO_STAGE=stage)
    out = _train(tmp_path / "run", tmp_path / "ledger", 20, ZERO_STAGE=stage,
                 DIE_IN_SETUP=f"r1:{where}")  # fmt: skip
    assert "restarting the worker group (restart 1 of 1)" in out, out
    if where == "init":  # the launcher says why: the run's group never formed
        assert "lost (killed by SIGKILL (signal 9)) before the run's group formed" in out, out
    assert out.count("done step=20") == 3 and "replacement" not in out, out
    assert _fit(out) == _fit(quiet)
