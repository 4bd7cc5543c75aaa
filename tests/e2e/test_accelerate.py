"""A phalanx script under `accelerate launch`, as docs/launch.md's "Accelerate users" says:
the documented forms on a machine without GPUs, the `prepare(optimizer, loader)` recipe,
and the two mistakes phalanx names (one process where several were asked, and phalanx's
DDP wrapped again in torch's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.ground.parent_launch import accelerate_processes_asked

pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install accelerate")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "accelerate_ddp.py"
TRAINER_SCRIPT = REPO / "tests" / "e2e" / "scripts" / "accelerate_trainer.py"
COMMON = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def _accelerate(
    flags: list[str], out: Path, mode: str | None, script: Path = SCRIPT
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert exe is not None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [exe, "launch", *flags, *COMMON, str(script), str(out), *([mode] if mode else [])],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=REPO,
    )


@pytest.mark.timeout(180)
def test_multi_gpu_form_starts_two_phalanx_ranks_that_stay_identical(tmp_path: Path) -> None:
    done = _accelerate(["--multi_gpu", "--num_processes", "2"], tmp_path, "ok")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["accelerate_processes"], r["steps"]) for r in records] == [
        (2, 2, 4),
        (2, 2, 4),
    ]  # 64 samples, batches of 8, sharded by accelerate's loader; check_replicas passed


@pytest.mark.timeout(180)
def test_a_trainer_script_trains_at_world_2_with_identical_replicas(tmp_path: Path) -> None:
    done = _accelerate(["--multi_gpu", "--num_processes", "2"], tmp_path, None, TRAINER_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["steps"]) for r in records] == [(2, 6), (2, 6)]


@pytest.mark.timeout(180)
def test_one_process_where_two_were_asked_is_named(tmp_path: Path) -> None:
    done = _accelerate(["--num_processes", "2"], tmp_path, "ok")
    assert done.returncode != 0
    assert (
        "ConfigurationError: accelerate launch was asked for --num_processes 2 but started "
        "this one process alone" in done.stderr
    ), done.stderr[-3000:]
    assert not list(tmp_path.glob("result_*.json"))


@pytest.mark.timeout(180)
def test_phalanx_ddp_given_to_prepare_is_refused_on_every_rank(tmp_path: Path) -> None:
    done = _accelerate(["--multi_gpu", "--num_processes", "2"], tmp_path, "wrap-twice")
    assert done.returncode != 0
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: ConfigurationError: phalanx's DistributedDataParallel is "
            "wrapped again in torch's" in done.stderr
        ), done.stderr[-3000:]


@pytest.mark.parametrize(
    ("argv", "asked"),
    [
        (["/v/bin/python", "/v/bin/accelerate", "launch", "--num_processes", "4", "t.py"], 4),
        (["python", "-m", "accelerate.commands.launch", "--num-processes=3", "t.py"], 3),
        (["/v/bin/accelerate", "launch", "--num-processes=3", "t.py"], 3),
        (["/v/bin/accelerate", "config"], None),
        (["python", "train.py", "--num_processes", "2"], None),
    ],
)
def test_the_parents_command_line_is_read_as_accelerate_reads_it(
    argv: list[str], asked: int | None
) -> None:
    assert accelerate_processes_asked(argv) == asked
