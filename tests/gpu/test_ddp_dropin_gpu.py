"""Reentrant checkpointing and static_graph on CUDA, against torch's DDP (one GPU, NCCL).

On CUDA the autograd engine runs a backward's nodes on a device thread; the
reducer's end-of-backward callback is queued from a hook on the outputs, so
it must still land on the outermost backward there. Skipped without CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.test_ddp_dropin import CheckpointedHead, SharedCheckpointed
from tests.harness import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train(ddp_class: Any, build: Any, kwargs: dict[str, Any]) -> list[float]:
    torch.manual_seed(0)
    net = build().cuda()
    model = ddp_class(net, device_ids=[0], **kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 16, device="cuda", generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in net.parameters()]).cpu().tolist()


def _both(rank: int, world_size: int) -> dict[str, float]:
    import phalanx

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", 0))
    gaps = {}
    cases = {
        "reentrant_head": (CheckpointedHead, {}),
        "static_shared": (SharedCheckpointed, {"static_graph": True}),
    }
    for name, (build, kwargs) in cases.items():
        ref = _train(torch.nn.parallel.DistributedDataParallel, build, kwargs)
        ours = _train(phalanx.DistributedDataParallel, build, kwargs)
        gaps[name] = max(abs(a - b) for a, b in zip(ref, ours))
    return gaps


@pytest.mark.timeout(120)
def test_reentrant_checkpointing_on_cuda_matches_torch() -> None:
    (outcome,) = run_workers(_both, 1, init_pg=False, timeout=100)
    for name, gap in outcome.value.items():
        assert gap <= 1e-5, f"{name}: parameters differ from torch DDP by {gap}"
