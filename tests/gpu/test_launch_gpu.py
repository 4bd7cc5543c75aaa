"""`phalanx launch` on GPUs: device counting, --virtual-local-rank, and NCCL through the
launcher-hosted store. Skipped without CUDA (the CI machines have none); run on a GPU
host with `pytest tests/gpu`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.launchkit import LAUNCH, REPO, clean_env

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROBE = """
import json, os, sys, torch, torch.distributed as dist
import phalanx
world = phalanx.init(backend="nccl", timeout=60)
t = torch.ones(1, device=world.device) * (world.rank + 1)
dist.all_reduce(t)
out = {"rank": world.rank, "local_rank": os.environ["LOCAL_RANK"], "device": str(world.device),
       "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
       "sum": t.item()}
open(os.path.join(sys.argv[1], f"gpu_{world.rank}.json"), "w").write(json.dumps(out))
phalanx.shutdown()
"""


def _launch(tmp_path: Path, *flags: str) -> list[dict[str, object]]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv = [*LAUNCH, *flags, str(script), str(tmp_path)]
    result = subprocess.run(
        argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gpu_*.json"))]


@pytest.mark.timeout(320)
def test_nproc_gpu_runs_one_nccl_rank_per_gpu(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    ranks = _launch(tmp_path, "--nproc-per-node", "gpu")
    assert len(ranks) == gpus
    assert [r["device"] for r in ranks] == [f"cuda:{i}" for i in range(gpus)]
    assert {r["sum"] for r in ranks} == {gpus * (gpus + 1) / 2}


@pytest.mark.timeout(320)
def test_virtual_local_rank_shows_each_worker_its_own_gpu(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    ranks = _launch(tmp_path, "--nproc-per-node", str(gpus), "--virtual-local-rank")
    assert [r["local_rank"] for r in ranks] == ["0"] * gpus
    assert [r["device"] for r in ranks] == ["cuda:0"] * gpus
    assert [r["count"] for r in ranks] == [1] * gpus
    assert [r["visible"] for r in ranks] == [str(i) for i in range(gpus)]


@pytest.mark.timeout(320)
def test_workers_forked_from_the_warm_server_use_their_gpu(tmp_path: Path) -> None:
    """--start-method forkserver: the server imported torch without starting CUDA, so each
    forked worker starts it itself, on its own GPU, and NCCL works (or, where importing
    loaded the CUDA driver, the launcher says so and starts them fresh: same result)."""
    gpus = torch.cuda.device_count()
    ranks = _launch(tmp_path, "--nproc-per-node", str(gpus), "--start-method", "forkserver")
    assert [r["device"] for r in ranks] == [f"cuda:{i}" for i in range(gpus)]
    assert {r["sum"] for r in ranks} == {gpus * (gpus + 1) / 2}
