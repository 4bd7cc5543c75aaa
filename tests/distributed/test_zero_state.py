"""ZeRO state leaves and comes back whole: the plain format, and sharded files that reshard.

A world-4 run saves its pieces with torch.distributed.checkpoint and its
consolidated state in the plain format; a world-2 run loads either and must
hold exactly the same state (and the other way round). The plain file loads
into a plain `torch.optim.Adam` over the plain model, and DCP's own converter
turns the sharded directory into whole tensors without phalanx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.models import mse_loss, regression_batch
from tests.distributed.test_zero_parity import Dominant, ManySmall
from tests.harness import run_workers


class Mixed(nn.Module):
    """A dominant layer and many small ones, so pieces cut tensors in every way."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Dominant()
        self.b = ManySmall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def _zero(model: nn.Module, stage: int) -> phalanx.ZeroRedundancyOptimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return phalanx.ZeroRedundancyOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest}],
        torch.optim.AdamW,
        shard_gradients=stage == 2,
        lr=0.01,
    )


def _build(stage: int) -> tuple[Any, phalanx.ZeroRedundancyOptimizer]:
    torch.manual_seed(7)
    model = phalanx.DistributedDataParallel(Mixed())
    return model, _zero(model, stage)


def _save(rank: int, world_size: int, directory: str, stage: int) -> None:
    model, opt = _build(stage)
    for step in range(3):
        x, y = regression_batch(rank, step, 0)
        mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.save_sharded(Path(directory) / "sharded")
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        plain = opt.state_dict()
        torch.save(
            {"model": model.module.state_dict(), "optimizer": plain}, f"{directory}/plain.pt"
        )


def _load(rank: int, world_size: int, directory: str, stage: int) -> None:
    """Load both forms, consolidate again, write what came back (tensors do not cross the queue)."""
    for how in ("sharded", "plain"):
        _, opt = _build(stage)
        if how == "sharded":
            opt.load_sharded(Path(directory) / "sharded")
        else:
            saved = torch.load(f"{directory}/plain.pt", weights_only=True)
            opt.load_state_dict(saved["optimizer"])
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(opt.state_dict(), f"{directory}/loaded-{how}.pt")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("saved", "loaded", "stage"), [pytest.param(4, 2, 1, marks=pytest.mark.slow), (2, 3, 2)]
)
def test_state_reshards_exactly(tmp_path: Path, saved: int, loaded: int, stage: int) -> None:
    run_workers(_save, saved, str(tmp_path), stage, timeout=120)
    reference = torch.load(tmp_path / "plain.pt", weights_only=True)["optimizer"]
    run_workers(_load, loaded, str(tmp_path), stage, timeout=120)
    for how in ("sharded", "plain"):
        got = torch.load(tmp_path / f"loaded-{how}.pt", weights_only=True)
        assert _same(got, reference), f"{how} load at world {loaded} differs"


@pytest.mark.timeout(120)
def test_plain_file_loads_into_the_plain_optimizer_and_dcp_converts_without_phalanx(
    tmp_path: Path,
) -> None:
    run_workers(_save, 2, str(tmp_path), 1, timeout=120)
    saved = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = Mixed()
    model.load_state_dict(saved["model"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": 0.1}, {"params": rest}]
    plain = torch.optim.AdamW(groups)
    plain.load_state_dict(saved["optimizer"])
    assert len(plain.state) == len(list(model.parameters()))
    for p in model.parameters():
        assert plain.state[p]["exp_avg"].shape == p.shape

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "sharded", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    for index, state in saved["optimizer"]["state"].items():
        whole = converted["state"][str(index)]["exp_avg_sq"]
        assert torch.equal(whole, state["exp_avg_sq"].reshape(-1))
