"""A worker whose script ended but whose exit never does (an exit handler, a group's
teardown) is shown and killed after `--exit-timeout`, not waited for forever.

Each worker's progress record says when its interpreter began to exit; the launcher
reads it (launch/exitwatch.py). Live recovery's case, where the run had finished and
the job still ends 0, is in tests/faults/test_live.py.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.launchkit import clean_env, launch

pytestmark = pytest.mark.faults

SCRIPT = textwrap.dedent(
    """
    import atexit, threading
    import torch, torch.distributed as dist
    import phalanx

    def hang_at_exit():
        threading.Event().wait()

    phalanx.init(backend="gloo", timeout=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {total.item():g}", flush=True)
    if dist.get_rank() == 1:
        atexit.register(hang_at_exit)
    """
)


@pytest.mark.timeout(90)
def test_a_worker_hung_in_its_exit_is_shown_and_killed(tmp_path: Path) -> None:
    script = tmp_path / "hang_at_exit.py"
    script.write_text(SCRIPT)
    # 10 s, not less: under the suite's load (three workers on two cores) rank 0's own
    # ordinary teardown once took over 3 s, and was reported as hung too
    run = launch("--nproc-per-node 2 --exit-timeout 10", script, env=clean_env(), merge=True,
                 timeout_s=80)  # fmt: skip
    out = run.stdout
    assert run.returncode != 0, out
    assert out.count("sum 2") == 2, out
    assert re.search(r"rank 1 began to exit [\d.]+ s ago and has not ended \(--exit-timeout 10\): "
                     r"hung in its teardown; killing it \(SIGKILL\)", out), out  # fmt: skip
    assert "in hang_at_exit" in out, out  # where it hangs: its Python stack
    assert "rank 0 began to exit" not in out, out  # rank 0 exited: nothing to say of it


@pytest.mark.timeout(60)
def test_a_bad_exit_timeout_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "nothing.py").write_text("")
    run = launch("--nproc-per-node 1 --exit-timeout 0", tmp_path / "nothing.py", env=clean_env())
    assert run.returncode != 0
    assert "--exit-timeout must be positive, got 0" in run.stderr, run.stderr
