"""Under --live-recovery, a run in which every worker fails ends with a summary (issue 36,
item 7, the launcher's side).

The launcher used to say "rank N lost (...); ... the others go on" for each worker,
with no other left to go on, and exit with no summary. Now it says no other worker is
left running, and once none is, it reports the losses and the first failure (its stderr
tail) as it does without live recovery. The workers need no torch: a worker that fails
at once is what the launcher watches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launchkit import launch

pytestmark = pytest.mark.faults

# Each worker beats once, as a phalanx worker does once its group has formed (a loss
# before any beat restarts the group instead: test_live_setup_loss.py), then fails.
FAIL = 'touch "$PHALANX_PROGRESS_DIR/live-r$RANK.beat"; echo boom from $RANK >&2; exit 3'


@pytest.mark.timeout(90)
def test_every_worker_lost_is_summed_up(tmp_path: Path) -> None:
    result = launch(
        "--nproc-per-node 2 --live-recovery --max-restarts 1 --no-python",
        "sh",
        "-c",
        FAIL,
        cwd=tmp_path,
        timeout_s=60,
    )
    err = result.stderr
    assert result.returncode == 3, err
    lost = [line for line in err.splitlines() if " lost (exit code 3)" in line]
    assert len(lost) == 3, err  # r0, r1 and the one replacement, j1
    assert "the others go on" not in lost[-1], err  # nobody was left to go on
    assert "no other worker is left running" in lost[-1]
    summary = err[err.index("no worker is left running: every one failed (") :]
    for member in ("r0 (rank 0): exit code 3", "r1 (rank 1): exit code 3", "j1"):
        assert member in summary.splitlines()[0], summary
    assert "FAILED: rank " in summary and "was the first to fail: exit code 3" in summary
    assert "|   boom from" in summary or "| boom from" in summary  # the first failure's stderr


# Rank 1 fails at once; rank 0 runs until the launcher has reported r1 lost in the store
# (an event), then finishes: the loss is said while there is another worker to go on.
SURVIVOR = """
import os, sys, time
from phalanx.ground.store_keys import lost_key
from phalanx.ground.storeclient import StoreClient
if os.environ["RANK"] == "1":
    sys.exit(3)
with StoreClient(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 30) as store:
    while not store.check([lost_key("r1")]):
        time.sleep(0.05)
"""


@pytest.mark.slow  # make test-slow: a guard (it passes on main too)
@pytest.mark.timeout(90)
def test_a_survivor_is_still_the_others_going_on(tmp_path: Path) -> None:
    result = launch(
        "--nproc-per-node 2 --live-recovery --no-python",
        sys.executable,
        "-c",
        SURVIVOR,
        cwd=tmp_path,
        timeout_s=60,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "rank 1 (r1) lost (exit code 3); no replacement left (--max-restarts), the others "
        "go on" in result.stderr
    )
    assert "every one failed" not in result.stderr
