"""The GPU check (`make gpu-check`): what only a machine with CUDA can show.

On one GPU: NCCL at world size 1, and gloo with CUDA tensors at world size 2
(both ranks on cuda:0, since NCCL refuses two ranks on one device). Skipped
where torch sees no CUDA device, which is every CI run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
Batch = namedtuple("Batch", ["x", "scale"])


def _python(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.timeout(120)
def test_init_picks_nccl_and_the_ranks_gpu() -> None:
    code = "import phalanx; w = phalanx.init(); print(w.backend, w.device, w.world_size)"
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["nccl", "cuda:0", "1"], proc.stdout


class NamedInputNet(nn.Module):
    """Takes a namedtuple: DDP must move it to the GPU and keep it a namedtuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, batch: Batch) -> torch.Tensor:
        assert isinstance(batch, Batch) and batch.x.is_cuda, type(batch)
        return self.b(torch.relu(self.a(batch.x))) * batch.scale


def _parity(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    import phalanx

    if backend == "nccl":
        phalanx.init()  # the harness's env describes a world of one: nccl on cuda:0
    torch.cuda.set_device(0)
    finals = []
    for wrap in (torch.nn.parallel.DistributedDataParallel, phalanx.DistributedDataParallel):
        torch.manual_seed(rank)
        model = wrap(NamedInputNet().cuda(), device_ids=[0])
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            batch = Batch(torch.randn(8, 16, generator=g), torch.tensor(1.5))  # on the CPU
            with torch.autocast("cuda", torch.bfloat16):
                out = model(batch)
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]))
    return {"gap": float((finals[0] - finals[1]).abs().max()), "device": str(finals[1].device)}


@pytest.mark.timeout(180)
def test_ddp_matches_torch_ddp_on_cuda_with_nccl() -> None:
    (o,) = run_workers(_parity, 1, "nccl", init_pg=False, timeout=150)
    assert o.value["device"] == "cuda:0" and o.value["gap"] <= 1e-6, o.value


@pytest.mark.timeout(180)
def test_ddp_matches_torch_ddp_with_gloo_on_cuda_tensors() -> None:
    for o in run_workers(_parity, 2, "gloo", timeout=150):
        assert o.value["device"] == "cuda:0" and o.value["gap"] <= 1e-6, o.value


def _zero_stages(rank: int, world_size: int) -> dict[str, float]:
    import phalanx
    from phalanx import zero3

    torch.cuda.set_device(0)
    finals: dict[str, torch.Tensor] = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
        )
        net = net.cuda()
        if stage == 3:
            phalanx.fully_shard(net[2])
            model: Any = phalanx.fully_shard(net)
            opt: Any = torch.optim.Adam(model.parameters(), lr=0.01)
        else:
            model = phalanx.DistributedDataParallel(net, device_ids=[0])
            opt = (
                torch.optim.Adam(model.parameters(), lr=0.01)
                if stage == 0
                else phalanx.ZeroRedundancyOptimizer(
                    model.parameters(), torch.optim.Adam, shard_gradients=stage == 2, lr=0.01
                )
            )
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            x = torch.randn(8, 16, generator=g).cuda()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if stage == 3:
            state = zero3.full_state_dict(model, to=0)
            params = [state[k] for k in state] if state is not None else []
        else:
            params = list(net.parameters())
        if params:  # rank 0's; the others return nothing
            finals[str(stage)] = torch.cat([p.detach().reshape(-1) for p in params])
    if rank != 0:
        return {}
    return {s: float((finals["0"] - finals[s]).abs().max()) for s in ("1", "2", "3")}


@pytest.mark.timeout(240)
def test_zero_stages_match_ddp_on_cuda() -> None:
    got = run_workers(_zero_stages, 2, timeout=200)[0].value
    assert all(gap <= 1e-5 for gap in got.values()), got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_trainer_mixed_precision_on_the_gpu(tmp_path: Path, precision: str) -> None:
    result = tmp_path / "r.json"
    proc = _python(
        str(SCRIPTS / "cuda_trainer.py"),
        str(tmp_path / "run"),
        str(result),
        "--precision",
        precision,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["device"] == "cuda:0", got
    assert torch.isfinite(torch.tensor(got["loss"])), got


@pytest.mark.timeout(300)
def test_cuda_rng_resume_is_bit_exact(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight.json", tmp_path / "resumed.json"
    proc = _python(str(SCRIPTS / "cuda_trainer.py"), str(tmp_path / "a"), str(straight))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = _python(
        str(SCRIPTS / "cuda_trainer.py"),
        str(tmp_path / "b"),
        str(resumed),
        "--max-steps",
        "6",
        "--save-steps",
        "6",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = _python(
        str(SCRIPTS / "cuda_trainer.py"), str(tmp_path / "b"), str(resumed), "--resume"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    assert a["params"] == b["params"], "resume on the GPU did not continue bit for bit"
