"""`phalanx launch --live-recovery` (issue 27): a worker killed or stopped mid-step, the
others going on at once, a replacement joining from a live peer's state, and the data exact.

The loop is tests/faults/scripts/live_loop.py: a hand-written phalanx DDP loop that
writes a ledger line per applied step (its step, the global sample offset after it,
the world it ran in). Merged over every member, the ledger must hold each step once
with one offset, the offsets advancing by exactly the world's samples per step: then
no sample was skipped or seen twice, and no applied step was lost.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.launchkit import FAULT_SCRIPTS, clean_env, launch

pytestmark = pytest.mark.faults

LOOP = FAULT_SCRIPTS / "live_loop.py"
BATCH = 4  # live_loop.py's per-rank batch
STEPS = 120


def _run(tmp_path: Path, flags: str, **env: str) -> tuple[int, str]:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    run = launch(
        f"--nproc-per-node 3 --live-recovery --live-stall-timeout 5 {flags}",
        LOOP,
        env=clean_env(
            LEDGER_DIR=str(ledger), STEPS=str(STEPS), PAUSE_S="0.05", OMP_NUM_THREADS="1", **env
        ),
        merge=True,
        timeout_s=150,
    )
    return run.returncode, run.stdout


def _ledger(tmp_path: Path) -> dict[int, set[tuple[int, int]]]:
    steps: dict[int, set[tuple[int, int]]] = {}
    for path in (tmp_path / "ledger").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["step"], set()).add((entry["offset"], entry["world"]))
    return steps


def _check_exact(tmp_path: Path) -> list[int]:
    """Every step applied once, with one offset, advancing by world x batch; the worlds."""
    steps = _ledger(tmp_path)
    assert sorted(steps) == list(range(1, STEPS + 1))
    offset, worlds = 0, list[int]()
    for step in range(1, STEPS + 1):
        assert len(steps[step]) == 1, f"members disagree at step {step}: {steps[step]}"
        ((after, world),) = steps[step]
        assert after == offset + world * BATCH, f"step {step} skipped or repeated samples"
        offset, worlds = after, [*worlds, world]
    return worlds


def _digests(out: str) -> set[str]:
    return set(re.findall(r"done step=\d+ offset=\d+ digest=(\S+)", out))


@pytest.mark.timeout(170)
@pytest.mark.parametrize("how", [pytest.param("SIGKILL", marks=pytest.mark.slow), "SIGSTOP"])
def test_survivors_go_on_and_a_replacement_joins(tmp_path: Path, how: str) -> None:
    code, out = _run(tmp_path, "--max-restarts 1", KILL_MEMBER="r1", KILL_STEP="10",
                     KILL_SIGNAL=how, HOLD_STEP="13", HOLD_WORLD="3")  # fmt: skip
    assert code == 0, out
    worlds = _check_exact(tmp_path)
    assert worlds[:10] == [3] * 10 and 2 in worlds and worlds[-1] == 3, worlds
    assert "replacement j1 starting" in out
    if how == "SIGSTOP":
        assert "fencing it off (SIGKILL)" in out
    assert re.search(r"\[j1\] joined: .*received=True", out), out
    assert len(_digests(out)) == 1 and out.count("done step=") == 3, out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_replacement_the_run_no_longer_needs_exits_0(tmp_path: Path) -> None:
    """Lost in the last step: the survivors finish before the replacement has started; it
    says so and exits 0 at once (not after its quorum timeout), and so does the job."""
    start = time.monotonic()
    code, out = _run(tmp_path, "--max-restarts 1 --live-quorum-timeout 90",
                     KILL_MEMBER="r1", KILL_STEP=str(STEPS - 1))  # fmt: skip
    assert code == 0, out
    assert f"replacement j1: the run finished (step {STEPS}) before it could join" in out, out
    assert out.count("done step=") == 2 and "NoQuorum" not in out, out
    assert time.monotonic() - start < 80, out


@pytest.mark.timeout(120)
def test_a_worker_hung_in_its_exit_is_fenced_with_its_stack(tmp_path: Path) -> None:
    """r2 finishes the run, then its exit never ends (its heartbeat stopped as the exit
    began): its launcher shows where it hangs and kills it after --exit-timeout, and
    the job ends 0 with no replacement, since the run had finished."""
    code, out = _run(tmp_path, "--max-restarts 1 --exit-timeout 5", HANG_AT_EXIT_MEMBER="r2")
    assert code == 0, out
    assert re.search(r"rank 2 \(r2\) began to exit [\d.]+ s ago and has not ended .*"
                     r"hung in its teardown; killing it \(SIGKILL\)", out), out  # fmt: skip
    assert "in hang_at_exit" in out, out  # its Python stack, from faulthandler
    assert "replacement" not in out and out.count("done step=") == 3, out
    assert _check_exact(tmp_path) == [3] * STEPS


@pytest.mark.timeout(120)
def test_no_quorum_stops_with_one_line(tmp_path: Path) -> None:
    start = time.monotonic()
    code, out = _run(tmp_path, "--live-min-members 3 --live-quorum-timeout 5",
                     KILL_MEMBER="r2", KILL_STEP="5")  # fmt: skip
    assert code != 0
    lines = [line for line in out.splitlines() if "NoQuorum: no quorum for generation 1" in line]
    assert len(lines) == 2, out  # once per survivor, one line each
    assert "missing r2 (lost)" in lines[0] and "2 of the 3 members" in lines[0]
    assert "Traceback" not in out
    assert time.monotonic() - start < 100


@pytest.mark.timeout(170)
def test_a_replacement_that_dies_on_admission_is_dropped(tmp_path: Path) -> None:
    """j1 is let in (at step 15, whenever it asks: the run waits for it) and dies before it
    connects: the members' wait for it ends within the connect bound, it is left out of the
    next generation, and the run finishes exact."""
    code, out = _run(tmp_path, "--max-restarts 1", KILL_MEMBER="r1", KILL_STEP="10",
                     DIE_ON_ADMISSION="j1", ADMIT_AT="15")  # fmt: skip
    assert code == 0, out
    worlds = _check_exact(tmp_path)
    assert worlds[:10] == [3] * 10 and worlds[-1] == 2, worlds
    assert "rank 1 (j1) lost" in out, out
    assert re.search(r"recovered: Recovered\(generation=3, members=\['r0', 'r2'\]", out), out
    assert len(_digests(out)) == 1 and out.count("done step=") == 2, out
