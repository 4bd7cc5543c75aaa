"""LocalSGD and DiLoCo on 2 real gloo ranks: the averages, the outer step, and exact resume.

Each claim is checked against arithmetic written out here, not against the
class itself: local SGD with one step per sync equals DDP; with four, the
parameters after a sync are the mean of the ranks' parameters just before
it; DiLoCo's parameters follow the paper's update written by hand (Nesterov
momentum on the averaged outer gradient). Resume: 6 steps, files, fresh
objects, 5 more must equal 11 straight steps bit for bit, mid-period, with
Adam inner state and BatchNorm buffers. All scenarios share one spawn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.errors import ConfigurationError
from phalanx.optim.local_sgd import PeriodicSync
from tests.distributed.models import MLP, flat, regression_batch, spread_from_rank0
from tests.harness import Outcome, run_scenarios, run_workers


class BNNet(nn.Module):
    """BatchNorm's running stats drift per rank like parameters: the syncs average them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = regression_batch(rank, step, 0, n=16)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _build(seed_rank: int) -> MLP:
    torch.manual_seed(seed_rank)  # ranks start apart: the wrap must broadcast rank 0's
    return MLP()


def _mean_over_ranks(vector: torch.Tensor) -> torch.Tensor:
    total = vector.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _local_h1_matches_ddp(rank: int, steps: int = 10) -> dict[str, float]:
    """Averaging after every plain SGD step is DDP's averaged-gradient step."""
    ddp = phalanx.DistributedDataParallel(_build(rank))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    local = _build(rank)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    phalanx.LocalSGD(local, local_opt, sync_every=1)
    for step in range(steps):
        _step(ddp, ddp_opt, rank, step)
        _step(local, local_opt, rank, step)
    a, b = flat(ddp.module.parameters()), flat(local.parameters())
    return {"diff": float((a - b).abs().max()), "spread": spread_from_rank0(b)}


def _local_average(rank: int, steps: int = 8, every: int = 4) -> dict[str, Any]:
    """After a sync the parameters are the mean of what the ranks held just before it."""
    model = _build(rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before: list[torch.Tensor] = []
    # Registered first, so it runs before LocalSGD's hook averages.
    opt.register_step_post_hook(lambda *_: before.append(flat(model.parameters())))
    local = phalanx.LocalSGD(model, opt, sync_every=every)
    gaps, spreads, flat_buffers = [], [], []
    for step in range(steps):
        _step(model, opt, rank, step)
        after = flat(model.parameters())
        spreads.append(spread_from_rank0(after))
        gaps.append(float((after - _mean_over_ranks(before[-1])).abs().max()))
        if local.in_sync:  # the flat buffer each sync went through
            flat_buffers.append([t.data_ptr() for t in local._flats.values()])
    return {
        "gaps": gaps,
        "spreads": spreads,
        "ratio": local.stats.compression_ratio(),
        "flat_buffers": flat_buffers,
    }


def _nesterov_reference(rank: int, steps: int, every: int) -> torch.Tensor:
    """DiLoCo by hand: inner SGD; every `every` steps the paper's outer Nesterov step."""
    model = MLP()
    model.load_state_dict(_rank0_state())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    anchor = flat(model.parameters())
    momentum: torch.Tensor | None = None
    for step in range(steps):
        _step(model, opt, rank, step)
        if (step + 1) % every:
            continue
        outer_grad = _mean_over_ranks(anchor - flat(model.parameters()))
        momentum = outer_grad if momentum is None else 0.9 * momentum + outer_grad
        anchor = anchor - 0.7 * (outer_grad + 0.9 * momentum)
        _load_flat(model, anchor)
    return flat(model.parameters())


def _rank0_state() -> dict[str, torch.Tensor]:
    return _build(0).state_dict()


def _load_flat(model: nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _diloco_matches_paper(rank: int, steps: int = 9, every: int = 3) -> dict[str, Any]:
    model = _build(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    diloco = phalanx.DiLoCo(model, opt, sync_every=every)
    grads_kept = True
    for step in range(steps):
        _step(model, opt, rank, step)
        # The inner gradients are handed back after the outer step (a caller may log them).
        grads_kept &= all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    ours = flat(model.parameters())
    reference = _nesterov_reference(rank, steps, every)
    return {
        "diff": float((ours - reference).abs().max()),
        "moved": float((ours - flat(_build(0).parameters())).abs().max()),
        "spread": spread_from_rank0(ours),
        "grads_kept": grads_kept,
        "in_sync": diloco.in_sync,
    }


def _resumable(kind: str, rank: int, path: Path, start: int, stop: int) -> torch.Tensor:
    torch.manual_seed(rank)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cls: Callable[..., PeriodicSync] = phalanx.LocalSGD if kind == "local" else phalanx.DiLoCo
    method = cls(model, opt, sync_every=4)
    if start:
        method.load_state_dict(torch.load(path, weights_only=True))
    for step in range(start, stop):
        _step(model, opt, rank, step)
    torch.save(method.state_dict(), path)
    return torch.cat([flat(model.parameters()), flat(model.buffers())])


def _resume(kind: str, rank: int, directory: str) -> dict[str, float]:
    base = Path(directory)
    straight = _resumable(kind, rank, base / f"{kind}-straight-{rank}.pt", 0, 11)
    _resumable(kind, rank, base / f"{kind}-split-{rank}.pt", 0, 6)
    resumed = _resumable(kind, rank, base / f"{kind}-split-{rank}.pt", 6, 11)
    # A sync at step 8 averaged the BatchNorm stats too: replicas were equal then.
    return {"diff": float((straight - resumed).abs().max()), "spread": spread_from_rank0(straight)}


def _buffers(rank: int) -> list[float]:
    """BatchNorm running stats: apart after a local step, equal after the sync."""
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    phalanx.LocalSGD(model, opt, sync_every=2)
    spreads = []
    for step in range(2):
        _step(model, opt, rank, step)
        spreads.append(spread_from_rank0(flat(model.buffers())))
    return spreads


def _refusals(rank: int) -> list[str]:
    messages = []
    ddp = phalanx.DistributedDataParallel(MLP())
    net, other = MLP(), MLP()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    for make in (
        lambda: phalanx.LocalSGD(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 4),
        lambda: phalanx.LocalSGD(net, torch.optim.SGD(other.parameters(), lr=0.1), 4),
        lambda: phalanx.DiLoCo(net, inner, 4, torch.optim.SGD(other.parameters(), lr=0.7)),
        lambda: phalanx.DiLoCo(net, inner, 4, inner),
    ):
        try:
            make()
            messages.append("no error")
        except ConfigurationError as exc:
            messages.append(str(exc))
    return messages


def _scenarios(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    scenarios: dict[str, Callable[[], Any]] = {
        "local_h1": functools.partial(_local_h1_matches_ddp, rank),
        "local_average": functools.partial(_local_average, rank),
        "diloco": functools.partial(_diloco_matches_paper, rank),
        "resume_local": functools.partial(_resume, "local", rank, directory),
        "resume_diloco": functools.partial(_resume, "diloco", rank, directory),
        "refusals": functools.partial(_refusals, rank),
        "buffers": functools.partial(_buffers, rank),
    }
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return run_workers(_scenarios, 2, str(tmp_path_factory.mktemp("local")), timeout=120)


def _values(outcomes: list[Outcome], name: str) -> list[Any]:
    for o in outcomes:
        value = o.value[name]
        assert not (isinstance(value, dict) and "error" in value), f"rank {o.rank}:\n{value}"
    return [o.value[name] for o in outcomes]


@pytest.mark.timeout(180)
def test_local_sgd_every_step_equals_ddp(run: list[Outcome]) -> None:
    for got in _values(run, "local_h1"):
        assert got["diff"] <= 1e-6, got
        assert got["spread"] == 0.0, got


@pytest.mark.timeout(180)
def test_local_sgd_averages_every_h_steps(run: list[Outcome]) -> None:
    for got in _values(run, "local_average"):
        synced = [3, 7]  # steps 4 and 8
        for step, (gap, spread) in enumerate(zip(got["gaps"], got["spreads"])):
            if step in synced:
                assert gap <= 1e-7 and spread == 0.0, (step, got)
            else:
                assert spread > 0.0, f"replicas equal at step {step + 1} without a sync: {got}"
        assert got["ratio"] == 0.25, "two syncs of the parameters in eight steps"
        first, second = got["flat_buffers"]
        assert len(first) == 1 and first == second, "one flat buffer, reused by every sync"


@pytest.mark.timeout(180)
def test_floating_buffers_are_averaged_at_syncs(run: list[Outcome]) -> None:
    for apart, synced in _values(run, "buffers"):
        assert apart > 0.0 and synced == 0.0, (apart, synced)


@pytest.mark.timeout(180)
def test_diloco_follows_the_papers_outer_step(run: list[Outcome]) -> None:
    for got in _values(run, "diloco"):
        assert got["moved"] > 1e-2, got
        assert got["diff"] <= 1e-6, got
        assert got["spread"] == 0.0 and got["in_sync"], got
        assert got["grads_kept"], "the inner gradients were not handed back after the sync"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["local", "diloco"])
def test_resume_mid_period_is_bit_identical(run: list[Outcome], kind: str) -> None:
    for got in _values(run, f"resume_{kind}"):
        assert got["diff"] == 0.0, got
        assert got["spread"] > 0.0, "11 steps with syncs every 4 should end between syncs"


@pytest.mark.timeout(180)
def test_refuses_ddp_and_foreign_or_shared_optimizers(run: list[Outcome]) -> None:
    for messages in _values(run, "refusals"):
        assert "pass the unwrapped module" in messages[0], messages
        assert "not a parameter of the module" in messages[1], messages
        assert "not a trainable parameter" in messages[2], messages
        assert "same optimizer as inner and outer" in messages[3], messages
