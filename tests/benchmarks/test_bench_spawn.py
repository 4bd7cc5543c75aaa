"""benchmarks/spawn.py: ranks of a benchmark that was killed do not compute on alone.

A real parent is SIGKILLed while its two gloo ranks sleep; both ranks must be
gone soon after (the kernel's parent-death signal), as they would not be with
multiprocessing alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import os, sys, time
sys.path.insert(0, {bench!r})
import spawn

def sleeper(rank, world, directory):
    with open(os.path.join(directory, f"rank{{rank}}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    spawn.run_ranks(sleeper, 2, {directory!r}, timeout=300)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().split()
    return stat[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(90)
def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(bench=str(ROOT / "benchmarks"), directory=str(tmp_path)))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
    pids_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in pids_files):
        assert parent.poll() is None, "the benchmark parent exited early"
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pids_files]
    assert all(alive(pid) for pid in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their benchmark"
