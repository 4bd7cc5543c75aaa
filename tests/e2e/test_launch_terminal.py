"""Rank 0's progress bar under `phalanx launch` when the console is a terminal (issue 13).

The launcher runs in a pseudo-terminal here, as in an interactive shell: rank 0's
tqdm must draw through it (carriage-return redraws, each on the bar's own line),
and rank 1's lines must come out whole, above the bar, which is drawn again below
them. Behind a pipe nothing of the kind may appear.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launchkit import LAUNCH, REPO, SCRIPTS, clean_env, launch

CLEAR = "\r\x1b[K"


def _launch_in_terminal(*args: str, timeout_s: float = 60) -> tuple[int, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen([*LAUNCH, *args], cwd=REPO, env=clean_env(),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)  # fmt: skip
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the launcher hung") from None
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(90)
@pytest.mark.skipif(sys.platform != "linux", reason="pseudo-terminals as on Linux")
def test_rank0_bar_is_drawn_on_a_terminal(tmp_path: Path) -> None:
    bar = str(SCRIPTS / "bar.py")
    code, screen = _launch_in_terminal("--nproc-per-node", "2", bar, "10", str(tmp_path))
    assert code == 0, screen
    redraws = [part.split("\r\n")[0] for part in screen.split(CLEAR)[1:]]
    bar_states = {r for r in redraws if r.startswith("[rank 0] train:")}
    assert len(bar_states) >= 5, screen  # drawn as it goes, not once at the end
    # The final state becomes an ordinary line when tqdm closes the bar.
    assert "[rank 0] train: 100%|" in screen.split("\r\n")[-2]
    for i in range(3):
        # Rank 1's line is whole, written over a cleared bar line, and the bar follows it.
        line = f"{CLEAR}[rank 1] rank 1 line {i}\r\n[rank 0] train:"
        assert line in screen, screen


@pytest.mark.timeout(60)
def test_no_bar_redraws_behind_a_pipe(tmp_path: Path) -> None:
    result = launch("--nproc-per-node 2", SCRIPTS / "bar.py", 10, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\x1b[K" not in result.stderr and "\x1b[K" not in result.stdout
    assert sorted(line for line in result.stdout.splitlines() if "rank 1 line" in line) == [
        f"[rank 1] rank 1 line {i}" for i in range(3)
    ]
