"""A parameter left on the meta device beside loaded ones (issue 36, item 9): only it is
initialised; its module's loaded tensors keep their values.

`materialize` runs each module's initialiser on the module, and torch's layers set all
their tensors there (`Linear.reset_parameters` draws weight and bias). A Linear whose
weight was loaded and whose bias was left on meta (a key missing from the checkpoint,
loaded with assign=True) had its loaded weight drawn again, with no word.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from phalanx.zero3 import has_meta_tensors, materialize


def _partly_loaded() -> tuple[nn.Sequential, dict[str, torch.Tensor]]:
    """A meta-built model given every tensor but `2.bias`, as load_state_dict(assign=True)
    does with a checkpoint that lacks one key."""
    torch.manual_seed(11)
    loaded = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).state_dict()
    del loaded["2.bias"]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    missing = model.load_state_dict(loaded, strict=False, assign=True).missing_keys
    assert missing == ["2.bias"]
    return model, {k: v.clone() for k, v in loaded.items()}


def test_the_loaded_siblings_of_a_meta_bias_keep_their_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, loaded = _partly_loaded()
    with caplog.at_level(logging.WARNING, logger="phalanx.zero3.meta_init"):
        done = materialize(model)
    assert not has_meta_tensors(model)
    state = model.state_dict()
    for name, value in loaded.items():
        assert torch.equal(state[name], value), f"{name} was drawn again"
    assert torch.isfinite(state["2.bias"]).all()
    assert done.tensors == 1
    assert "materialize: 2.bias still on the meta device beside loaded tensors" in caplog.text


def test_the_meta_bias_gets_what_an_unloaded_build_draws_for_it() -> None:
    """The initialiser still runs on the whole module (same draws as a build from scratch),
    so the bias is the one the same seed gives a model built on the CPU."""
    model, _ = _partly_loaded()
    torch.manual_seed(3)
    materialize(model)
    torch.manual_seed(3)
    reference = nn.Linear(8, 2)
    assert torch.equal(model.state_dict()["2.bias"], reference.bias)
