"""A script converted from torch DDP by changing the import is protected at exit, as by init().

gloo can abort a process that finished ("terminate called without an active
exception") when its group is still alive while the interpreter finalizes;
`phalanx.init()` tears the group down at exit. A converted script never calls
init, so wrapping the first model must install the same teardown.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "ddp_no_init.py"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_converted_script_tears_the_group_down_at_exit() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2", str(SCRIPT)],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=80,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "terminate called" not in out, out
    for rank in (0, 1):
        assert f"rank {rank}: trained" in out, out
        assert f"rank {rank}: group alive at exit: False" in out, out
