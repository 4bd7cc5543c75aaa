"""`materialize` in one process: a meta-built model gets exactly the values the same model
built on the CPU after the same seed gets, keeps what was not meta, and names what no
initialiser sets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.zero3 import has_meta_tensors, materialize


class Tied(nn.Module):
    """Embedding, norm, conv, linears and a head tied to the embedding: torch's layers only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight


def test_a_meta_model_gets_the_values_of_the_same_model_built_on_the_cpu() -> None:
    torch.manual_seed(7)
    reference = Tied()
    torch.manual_seed(7)
    with torch.device("meta"):
        model = Tied()
    assert has_meta_tensors(model)
    done = materialize(model)
    assert not has_meta_tensors(model)
    assert model.head.weight is model.embed.weight, "the tie was lost"
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    own = [[*m._parameters.values(), *m._buffers.values()] for m in reference.modules()]
    largest = max(sum(t.nbytes for t in ts if t is not None) for ts in own if ts)
    assert done.largest_temporary_bytes == largest  # one module's own tensors at a time


def test_what_was_not_meta_keeps_its_values() -> None:
    """accelerate's init_empty_weights() leaves buffers real: a computed mask must survive."""
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    model.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    materialize(model)
    assert isinstance(model.mask, torch.Tensor)
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))
    assert torch.isfinite(model.weight).all()


class _Raw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))  # set in __init__, by no reset_parameters


def test_a_tensor_no_initialiser_sets_is_named() -> None:
    with torch.device("meta"):
        model = _Raw()
    with pytest.raises(ConfigurationError, match=r"parameter 'scale' of _Raw .*meta device"):
        materialize(model)


def test_a_given_initialiser_runs_on_full_size_tensors() -> None:
    with torch.device("meta"):
        model = _Raw()
    shapes: list[tuple[int, ...]] = []

    def init(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            shapes.append(tuple(p.shape))
            nn.init.constant_(p, 0.5)

    materialize(model, init=init)
    assert sorted(shapes) == [(3,), (3,), (3, 3)]
    assert all(bool((p == 0.5).all()) for p in model.parameters())
