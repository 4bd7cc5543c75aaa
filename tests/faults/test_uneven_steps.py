"""A rank that runs out of data without Join is named as such, not as a closed connection
(issue 24).

Before: rank 0 ended its loop after 3 steps and exited; rank 1's fourth all-reduce
failed with gloo's "Connection closed by peer", and the summary read `FAILED: rank 1
... was the first to fail: exit code 1`, the traceback's last line the only clue.
Now the ranks' progress records show that rank 0 exited cleanly after fewer
collectives than rank 1 entered, and the summary says the ranks ran different
numbers of steps and how to even them out. A rank that failed with an exception
after fewer collectives is not taken for one out of data.
"""

from __future__ import annotations

import pytest

from tests.launchkit import FAULT_SCRIPTS, launch

pytestmark = pytest.mark.faults

SCRIPT = FAULT_SCRIPTS / "uneven_steps.py"


@pytest.mark.timeout(90)
def test_a_rank_out_of_steps_is_named_not_a_closed_connection() -> None:
    res = launch("--nproc-per-node 2", SCRIPT, "exit", timeout_s=80)
    assert res.returncode == 1, res.stderr
    assert "Connection closed by peer" in res.stderr  # what rank 1 itself saw
    summary = next(line for line in res.stderr.splitlines() if "FAILED" in line)
    assert summary.startswith(
        "[phalanx] FAILED: the ranks ran different numbers of steps: rank 0 finished "
        "(exit code 0) after collective #3, while rank 1 (local rank 1 on node 0, pid "
    ), res.stderr
    assert "went on to #4 (ddp all_reduce bucket 0, iteration 4) and failed there" in summary
    assert "even_batches=True" in summary and "phalanx.Join([model])" in summary
    assert "  rank 0: last collective entered: #3 (ddp all_reduce bucket 0, iteration 3)" in (
        res.stderr
    )
    assert "did not arrive" not in res.stderr


@pytest.mark.timeout(90)
def test_a_rank_that_raised_is_not_said_to_have_run_out() -> None:
    res = launch("--nproc-per-node 2", SCRIPT, "raise", timeout_s=80)
    assert res.returncode == 1, res.stderr
    assert "ValueError: rank 0 failed in its last step" in res.stderr
    assert "different numbers of steps" not in res.stderr
