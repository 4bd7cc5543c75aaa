"""PowerSGD, LocalSGD and DiLoCo on CUDA tensors over NCCL (skipped without a GPU).

On NCCL a collective's future completes when its work is enqueued, so the
PowerSGD chain runs inline; this checks that path gives torch's hook's
parameters bit for bit on phalanx's reducer, and that the local methods
synchronise CUDA parameters. One rank per visible GPU, up to 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import phalanx
from phalanx.ddp.comm_hooks import PowerSGDState, powersgd_hook
from tests.harness import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    ).to(device)


def _train(model: nn.Module, rank: int, device: torch.device, steps: int = 12) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = (
            torch.randn(32, 64, generator=g).to(device),
            torch.randn(32, 8, generator=g).to(device),
        )
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        params = {}
        # torch's hook takes torch's GradBucket; phalanx's reducer hands it its own, which
        # has the same methods (the drop-in promise), so the pair is typed loosely here.
        cases: tuple[tuple[str, Callable[..., Any], Any], ...] = (
            ("torch", torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState(None, 4, 3)),
            ("ours", powersgd_hook, PowerSGDState(None, 4, 3)),
        )
        for name, hook, state in cases:
            model = phalanx.DistributedDataParallel(_net(device), device_ids=[device])
            model.register_comm_hook(state, hook)
            _train(model, rank, device)
            params[name] = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        net = _net(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        local = phalanx.DiLoCo(net, opt, sync_every=4)
        g = torch.Generator().manual_seed(rank)
        for _ in range(8):
            x = torch.randn(16, 64, generator=g).to(device)
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return {
            "hook_diff": float((params["torch"] - params["ours"]).abs().max()),
            "in_sync": local.in_sync,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_powersgd_and_diloco_on_cuda() -> None:
    world = min(2, torch.cuda.device_count())
    outcomes = run_workers(
        _worker,
        world,
        init_pg=False,
        timeout=150,
        env={"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")},
    )
    for o in outcomes:
        assert o.value["hook_diff"] == 0.0, o.value
        assert o.value["in_sync"], o.value
