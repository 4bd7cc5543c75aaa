"""Stage 3 with CPUOffloadPolicy on a CUDA device: shards and gradients in pinned host memory,
gathers copied to the device, the optimizer stepping on the host.

Skipped without CUDA. One process over NCCL (one GPU is enough): the Trainer's
`zero_offload="cpu"` run must keep every shard and gradient on the CPU, pinned,
and end within 1e-5 of the same run without offload after 20 steps with
clipping and accumulation; the step times of both are printed (their ratio is
the number `make gpu-check` reports).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx import zero3
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.config.args import ZeroOffload

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor  # the parameters' type under stage 3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))
        self.head = nn.Linear(512, 8)

    def forward(self, batch: list[Tensor]) -> Tensor:
        x = batch[0]
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _run(out: Path, offload: ZeroOffload | None) -> tuple[dict[str, Tensor], float, list[Any]]:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(640, 512, generator=gen), torch.randint(0, 8, (640,), generator=gen)
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=20,
        save_steps=1000,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=1e-3,
        zero_stage=3,
        zero_offload=offload,
        ddp_backend="nccl",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=_Net(),
        args=args,
        train_dataset=data,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
    )
    homes = [
        (shard.device.type, shard.is_pinned())
        for shard in (cast("DTensor", p)._local_tensor for p in trainer.model.parameters())
    ]
    start = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    grads = [p.grad for p in trainer.model.parameters()]
    full = zero3.full_state_dict(trainer.model, to=0)
    assert full is not None
    trainer.close()
    return {k: v.cpu() for k, v in full.items()}, elapsed, homes + [g is None for g in grads]


def test_cpu_offload_equals_in_memory_on_cuda(tmp_path: Path) -> None:
    plain, plain_s, _ = _run(tmp_path / "plain", None)
    offloaded, offload_s, homes = _run(tmp_path / "cpu", "cpu")
    shards = [h for h in homes if isinstance(h, tuple)]
    assert shards and all(h == ("cpu", True) for h in shards), shards
    for key in plain:
        assert (plain[key] - offloaded[key]).abs().max().item() <= 1e-5, key
    print(f"CPU offload step time / in-memory stage 3: {offload_s / plain_s:.2f}")
