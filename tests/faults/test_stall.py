"""A stuck rank is reported as the stuck rank, not as a failure of a healthy one (issue 12,
item 6); and, while the ranks are stuck, the store listens on loopback only (item 11: `ss -ltn`
sees 127.0.0.1 whether `phalanx launch` hosts the store or rank 0 does).

Rank(s) stall (sleep) at a step while the others wait in the next all-reduce
until `init(timeout=...)` runs out. Under `phalanx launch` the summary must name
the stuck rank(s), where every rank stood, and the stuck ranks' Python stacks,
within the timeout + 20 s of the stall. Without our launcher (torchrun, srun, or
a hand-set environment) each rank prints its own position and stacks.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.ground.ports import free_port
from tests.launchkit import (
    FAULT_SCRIPTS,
    LAUNCH,
    REPO,
    TORCHRUN,
    clean_env,
    finish,
    listening_addresses,
    start,
    wait_for,
)

pytestmark = pytest.mark.faults

STALL = FAULT_SCRIPTS / "stall.py"


def _run_stall(out: Path, nproc: int, stuck: str, step: int, timeout: int) -> tuple[str, float]:
    """Launch stall.py; (the launcher's stderr, seconds from the first stall to its exit).

    While the ranks are stalled, the store must listen on loopback only (issue 12, item 11).
    """
    port = free_port()
    launcher = start([*LAUNCH, "--nproc-per-node", nproc, "--master-port", port, STALL, stuck,
                      step, timeout, out])  # fmt: skip
    first_stuck = int(stuck.split(",")[0])
    try:
        wait_for([out / f"stalled_{first_stuck}"], timeout_s=150)
        listening = listening_addresses(port)
    finally:
        _, err = finish(launcher, timeout_s=180)
    ended = time.time()
    first_stall = min(float(p.read_text()) for p in out.glob("stalled_*"))
    assert launcher.returncode == 203, err  # a peer hung: retryable (docs/clusters.md)
    assert listening == {"127.0.0.1"}
    return err, ended - first_stall


def _summary(err: str) -> str:
    return "\n".join(
        line.removeprefix("[phalanx] ") for line in err.splitlines() if line.startswith("[phalanx]")
    )


@pytest.mark.timeout(200)
def test_the_stuck_rank_is_named_with_its_stack(tmp_path: Path) -> None:
    err, took = _run_stall(tmp_path, nproc=2, stuck="1", step=3, timeout=5)
    summary = _summary(err)
    pattern = (
        r"FAILED: rank 1 did not arrive at collective #(\d+) \(ddp all_reduce bucket 0, "
        r"iteration 3\): rank 0 .* waited for it there"
    )
    headline = re.search(pattern, summary)
    assert headline, summary
    waited_in = int(headline[1])
    assert re.search(rf"rank 0: last collective entered: #{waited_in} \(.*iteration 3\).*"
                     "<- failed first", summary), summary  # fmt: skip
    assert re.search(rf"rank 1: last collective entered: #{waited_in - 1} \(.*iteration 2\).*"
                     "<- did not arrive", summary), summary  # fmt: skip
    stacks = summary[summary.index("the Python stacks of rank 1:") :]
    assert "in stall_here" in stacks and "stall.py" in stacks
    assert took < 5 + 20, f"the summary came {took:.0f}s after the stall"
    # torch's "[rank0]:" traceback prefix is dropped: the launcher already says the rank.
    assert "[rank0]:" not in err and "[rank 0] RuntimeError" in err


def _start_rank(rank: int, port: int, out: Path, stuck: str, timeout: int) -> subprocess.Popen[str]:
    """One rank with a hand-set environment, as srun or a script would start it."""
    env = clean_env(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    argv = [sys.executable, STALL, stuck, 3, timeout, out]
    return start(argv, env=env)


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    """stderr of `proc` up to the first line holding `needle` and the stack that follows."""
    assert proc.stderr is not None
    fd, text, deadline = proc.stderr.fileno(), b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            text += os.read(fd, 65536)
        decoded = text.decode(errors="replace")
        if needle in decoded and "stall_here" in decoded[decoded.index(needle) :]:
            return decoded
    raise AssertionError(f"never printed {needle!r}:\n{text.decode(errors='replace')}")


@pytest.mark.slow  # make test-slow: over a minute on a loaded 2-core machine
@pytest.mark.timeout(200)
def test_without_our_launcher_each_rank_reports_itself(tmp_path: Path) -> None:
    port = free_port()
    ranks = [_start_rank(r, port, tmp_path, "1", timeout=5) for r in range(2)]
    try:
        wait_for([tmp_path / "stalled_1"], timeout_s=150)
        # Rank 0 hosts the store here (no launcher): on loopback only, as all ranks are local.
        assert listening_addresses(port) == {"127.0.0.1"}
        report = _read_until(ranks[1], "[phalanx] rank 1: no collective progress", 120)
        assert "the collective timeout is 5s" in report
        assert re.search(r"last collective entered: #\d+ \(ddp all_reduce bucket 0, "
                         r"iteration 2\)", report), report  # fmt: skip
        _, rank0_err = finish(ranks[0], timeout_s=60)
        assert ranks[0].returncode != 0 and "Timed out" in rank0_err
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_of_four_ranks_stall(tmp_path: Path) -> None:
    """The issue's case at full size: timeout 10, stall at step 5, two stuck ranks of four."""
    err, took = _run_stall(tmp_path, nproc=4, stuck="1,3", step=5, timeout=10)
    summary = _summary(err)
    pattern = (
        r"FAILED: ranks 1, 3 did not arrive at collective #\d+ \(ddp all_reduce bucket 0, "
        r"iteration 5\): rank [02] .* waited for them"
    )
    assert re.search(pattern, summary), summary
    for rank in (1, 3):
        assert re.search(rf"rank {rank}: .*iteration 4\).*<- did not arrive", summary), summary
        assert f"the Python stacks of rank {rank}:" in summary
    assert took < 10 + 20, f"the summary came {took:.0f}s after the stall"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_torchrun_the_stuck_rank_reports_itself(tmp_path: Path) -> None:
    """torchrun reports rank 0's timeout only; our stuck rank 1 prints where it is first."""
    argv = [*TORCHRUN, "--nproc-per-node", "2", STALL, "1", "3", "5", tmp_path]
    result = subprocess.run([str(a) for a in argv], cwd=REPO, env=clean_env(), text=True,
                            capture_output=True, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "[phalanx] rank 1: no collective progress" in result.stderr, result.stderr[-3000:]
    assert "in stall_here" in result.stderr
