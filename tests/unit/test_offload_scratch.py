"""The offload scratch directory under faults from outside the run (issue 36, item 11).

- A directory (or a file) removed under a running process used to surface as a raw
  FileNotFoundError from the step's I/O thread; it is an OffloadError in one line.
- Scratch names carried the owner's pid alone, so a process in another PID namespace
  sharing the directory (another container) read our pid as dead in its own
  numbering and deleted our live scratch; the names now carry host, boot id and PID
  namespace, and a sweep judges only its own.
- A pid no process can have (99999999999) made the sweep raise OverflowError.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx.errors import OffloadError
from phalanx.offload import OffloadFiles
from phalanx.offload.files import sweep_dead_runs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path: Path) -> Iterator[OffloadFiles]:
    out = OffloadFiles(tmp_path / "scratch", 0, "zero_offload_dir")
    yield out
    out.close()


def test_a_deleted_directory_is_one_offload_error(files: OffloadFiles) -> None:
    state = files.copy(torch.arange(4096, dtype=torch.float32))
    shutil.rmtree(files.directory)  # a cleanup job, mid-run
    assert float(state.sum()) == float(sum(range(4096)))  # the mapping itself still holds
    for use in (lambda: files.release([state]), lambda: files.tensor((64,), torch.float32)):
        with pytest.raises(OffloadError) as caught:
            use()
        message = str(caught.value)
        assert message.startswith(f"zero_offload_dir={files.parent}: the offload directory ")
        assert "was deleted while the run used it" in message and "\n" not in message


def test_a_deleted_file_is_one_offload_error(files: OffloadFiles) -> None:
    state = files.copy(torch.ones(4096))
    region = files.region(state)
    assert region is not None
    region.path.unlink()
    with pytest.raises(OffloadError, match=r"offload file .* was deleted while the run used it"):
        files.release([state])


def _name_with_pid(files: OffloadFiles, pid: int | str) -> str:
    """`files`' directory name with its owner's pid replaced by `pid`."""
    mine = f"-{os.getpid()}-rank"
    assert files.directory.name.count(mine) == 1, files.directory.name
    return files.directory.name.replace(mine, f"-{pid}-rank")


def test_a_pid_no_process_can_have_is_swept_without_overflow(files: OffloadFiles) -> None:
    planted = files.parent / _name_with_pid(files, 99999999999)
    planted.mkdir()
    assert sweep_dead_runs(files.parent) == [planted]  # nobody's: no process has that pid
    assert files.directory.is_dir()


def test_a_dead_owner_of_this_namespace_is_still_swept(files: OffloadFiles) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    stale = files.parent / _name_with_pid(files, int(gone.stdout))
    stale.mkdir()
    assert sweep_dead_runs(files.parent) == [stale]
    assert files.directory.is_dir()


SWEEP_THERE = "import sys; from pathlib import Path; from phalanx.offload.files import \
sweep_dead_runs; print(sweep_dead_runs(Path(sys.argv[1])))"


@pytest.mark.timeout(60)
def test_another_pid_namespace_leaves_our_live_scratch_alone(files: OffloadFiles) -> None:
    """A process in a PID namespace of its own (pid 1 there, as in a container) sweeps the
    shared directory: our pid is no process of its namespace, yet our scratch is live."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux's unshare for a PID namespace")
    command = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        sys.executable,
        "-c",
        SWEEP_THERE,
        str(files.parent),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    swept = subprocess.run(command, capture_output=True, text=True, timeout=50, env=env)
    if swept.returncode != 0 and "unshare" in swept.stderr:
        pytest.skip(f"cannot make a PID namespace here: {swept.stderr.strip()}")
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.strip() == "[]", swept.stdout
    assert files.directory.is_dir(), "another namespace deleted our live scratch"
