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

from phalanx.ground.ports import free_port
from tests.faults.test_live_trainer import SCRIPT, _fit, _train
from tests.launchkit import LAUNCH, clean_env, finish, secret_file, start

pytestmark = pytest.mark.faults


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("where", "stage"),
    # make test keeps one point (the restart is one mechanism wherever it is lost): the
    # suite's 10 minutes on 2 cores; test-slow runs every point
    [("init", "0"), pytest.param("train", "0", marks=pytest.mark.slow),
     pytest.param("built", "0", marks=pytest.mark.slow),
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lost", ["r3", pytest.param("r1", marks=pytest.mark.slow)])
def test_a_loss_before_the_group_forms_restarts_every_node(tmp_path: Path, lost: str) -> None:
    """Two launchers (node 0 hosts the store; ranks 0-1 and 2-3): a worker of either node
    killed before the run's group formed. Its launcher restarted its own group alone, and
    the other node's workers waited in the formation for the run's timeout (30 minutes)
    while the restarted node waited for a store the host never served again. Now its
    launcher asks every node to restart (a signed key in the store, acknowledged), and
    the run ends as an undisturbed one does."""
    secret = secret_file(tmp_path / "run.secret")
    port = free_port()
    env = clean_env(LEDGER_DIR=str(tmp_path / "ledger"), OMP_NUM_THREADS="1",
                    DIE_IN_SETUP=f"{lost}:init")  # fmt: skip
    (tmp_path / "ledger").mkdir()
    procs = [
        start([*LAUNCH, "--nnodes", "2", "--node-rank", node, "--master-addr", "127.0.0.1",
               "--master-port", port, "--nproc-per-node", "2", "--live-recovery",
               "--live-stall-timeout", "5", "--max-restarts", "1", "--rdzv-timeout", "60",
               "--run-secret-file", secret, SCRIPT, tmp_path / "out", 20], env)
        for node in (0, 1)
    ]  # fmt: skip
    outs = [finish(proc, 240) for proc in procs]
    text = "\n".join(out + err for out, err in outs)
    assert [proc.returncode for proc in procs] == [0, 0], text
    host = 0 if lost == "r1" else 1
    said = f"node {host}: rank {lost[1]} ({lost}) lost (killed by SIGKILL (signal 9)) before"
    other = outs[1 - host][0] + outs[1 - host][1]
    assert said in other and "restarts with it" in other, text
    assert text.count("restarting the worker group (restart 1 of 1)") == 2, text
    assert text.count("done step=20") == 4, text
