"""The `phalanx` command's own frictions, as a newcomer meets them (issue 35, item 10):
`--version`, a did-you-mean for a mistyped command or launch flag, and a warning when
CPU workers outnumber the cores. Each in one line, through the real command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx.launch.devices import gpu_count

REPO = Path(__file__).resolve().parents[2]


def _phalanx(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


@pytest.mark.timeout(60)
def test_version_names_phalanx_torch_and_python_without_importing_torch() -> None:
    import torch

    probe = (
        "import sys\n"
        "from phalanx.cli.main import main\n"
        "assert main(['--version']) == 0\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"phalanx {phalanx.__version__} (torch {torch.__version__}, ")
    assert _phalanx("--version").stdout == done.stdout


@pytest.mark.timeout(60)
def test_a_mistyped_command_is_one_line_naming_the_nearest() -> None:
    done = _phalanx("lauch", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "unknown command 'lauch' (did you mean 'launch'?)" in done.stderr
    far = _phalanx("train.py")
    assert "did you mean" not in far.stderr and "unknown command 'train.py'" in far.stderr


@pytest.mark.timeout(60)
def test_a_mistyped_launch_flag_is_one_line_naming_the_nearest() -> None:
    done = _phalanx("launch", "--nproc-per-nod", "2", "examples/digits.py")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "unrecognized arguments: --nproc-per-nod (did you mean --nproc-per-node?)" in (
        done.stderr
    )
    both = _phalanx("launch", "--nproc_per_nod=2", "--max-restart", "1", "examples/digits.py")
    assert "(did you mean --nproc_per_node and --max-restarts?)" in both.stderr


@pytest.mark.timeout(60)
def test_more_cpu_workers_than_cores_is_a_warning_and_the_job_runs(tmp_path: Path) -> None:
    if gpu_count():
        pytest.skip("a GPU is visible: workers compute there, and no warning is due")
    cores = len(os.sched_getaffinity(0))
    done = _phalanx(
        "launch", "--nproc-per-node", str(cores + 1), "--no-python", "true", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning:" in line]
    assert warnings == [
        f"[phalanx] warning: --nproc-per-node {cores + 1} starts more workers than the "
        f"{cores} cores this launcher may use, and no GPU is visible: they will share the "
        f"cores — fine for a test; for speed, --nproc-per-node {cores} or fewer"
    ]
    fits = _phalanx("launch", "--nproc-per-node", str(cores), "--no-python", "true", cwd=tmp_path)
    assert fits.returncode == 0 and "warning:" not in fits.stderr


def test_no_warning_where_a_gpu_computes() -> None:
    from phalanx.cli.launch_cmd import _more_workers_than_cores

    assert _more_workers_than_cores(8, gpus=8, cores=2) == ()
    assert _more_workers_than_cores(2, gpus=0, cores=2) == ()
    assert _more_workers_than_cores(3, gpus=0, cores=2)
