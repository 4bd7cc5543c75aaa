"""A re-deal after an iteration cut short (live recovery at stage 3) starts every rank from
the same place: no unit left mid-forward or mid-backward, nothing waiting to be reduced,
and the end of backward free to be queued again.

Each rank of a real 2-rank gloo group stops one iteration in a different place (rank 0
inside the forward, rank 1 inside the backward), as two survivors of a lost peer do; after
`zero3.redeal`, a full step must run on both with their collectives paired, and give the
loss a never-interrupted copy gives. Before `Root.abandon`, a unit left in BACKWARD or a
queued end of backward made the ranks' next gathers differ. The traffic counted so far
survives the re-deal (its new groups count on from the old ones': the log's per-step
figures went negative after a recovery).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from phalanx import zero3
from phalanx.zero3.unit import UnitPhase
from tests.harness import run_workers


class _Stop(Exception):
    pass


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.stop_in: int | None = None  # raise in this layer's forward

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == self.stop_in:
                raise _Stop
        return x


def _cut_short(model: _Net, rank: int, x: Tensor) -> None:
    """Rank 0 stops in the forward (after two layers); rank 1 in the backward."""
    if rank == 0:
        model.stop_in = 2
        with pytest.raises(_Stop):
            model(x)
        model.stop_in = None
        return
    out = model(x).sum()

    def stop(grad: Tensor) -> Tensor:
        raise _Stop

    out.register_hook(stop)
    with pytest.raises(_Stop):
        out.backward()


def _whole(tensor: Tensor | None) -> Tensor:
    """A DTensor's whole value (a collective)."""
    assert tensor is not None
    whole: Tensor = tensor.full_tensor()  # type: ignore[attr-defined]
    return whole.detach().clone()


def _scenario(rank: int, world: int) -> dict[str, Any]:
    model, ref = _Net(), _Net()
    for net in (model, ref):
        for layer in net.layers:
            zero3.fully_shard(layer)
        zero3.fully_shard(net)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for net in (model, ref):
        net(x).sum().backward()  # one whole step each: the order is recorded
    wholes = [_whole(p) for p in zero3.sharded_parameters(model)]
    _cut_short(model, rank, x)
    sent = zero3.communication(model).collectives
    zero3.redeal(model, wholes)
    phases = [u.phase.value for u in zero3.units(model)]
    counted = (sent, zero3.communication(model).collectives)
    losses = []
    for net in (model, ref):
        for p in net.parameters():
            p.grad = None
        loss = net(x).sum()
        loss.backward()
        losses.append(float(loss))
    grads = [_whole(p.grad).sum().item() for p in zero3.sharded_parameters(model)]
    ref_grads = [_whole(p.grad).sum().item() for p in zero3.sharded_parameters(ref)]
    return {"phases": phases, "losses": losses, "grads": (grads, ref_grads), "counted": counted}


@pytest.mark.timeout(120)
def test_a_redeal_after_an_iteration_cut_short_pairs_every_rank_again() -> None:
    for outcome in run_workers(_scenario, 2, timeout=90):
        value = outcome.value
        assert set(value["phases"]) == {UnitPhase.IDLE.value}, value
        assert value["losses"][0] == value["losses"][1], value
        assert value["grads"][0] == value["grads"][1], value
        before, after = value["counted"]  # the log's traffic never goes back (per-step < 0)
        assert after == before > 0, value
