"""The host copy a background save writes (train/checkpoint/staging.py): the step's values,
whatever the next step does to the live state, and the very bytes torch.save would write."""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from phalanx.train.callbacks import Callbacks, TrainerCallback
from phalanx.train.checkpoint.staging import Stager, stage


def _saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True), len(buffer.getvalue())


def test_the_copy_keeps_the_steps_values_while_the_live_state_moves_on() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    before = _saved(state)[0]
    staged, copied = stage(state)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # parameters and Adam's moments change in place, "step" too
    after = _saved(staged)[0]
    assert torch.equal(after["model"]["weight"], before["model"]["weight"])
    assert torch.equal(
        after["optimizer"]["state"][0]["exp_avg"], before["optimizer"]["state"][0]["exp_avg"]
    )
    assert after["optimizer"]["state"][0]["step"] == before["optimizer"]["state"][0]["step"]
    assert copied == sum(t.nbytes for t in model.state_dict().values()) + sum(
        t.nbytes for s in optimizer.state_dict()["state"].values() for t in s.values()
    )


def test_views_and_shared_storages_are_copied_once_and_kept_as_views() -> None:
    flat = torch.arange(12.0)
    state = {"a": flat[2:5], "b": flat.view(3, 4), "tied": flat[2:5]}
    staged, copied = stage(state)
    assert copied == flat.nbytes  # one storage, once
    assert staged["a"].untyped_storage().data_ptr() == staged["b"].untyped_storage().data_ptr()
    assert staged["b"].stride() == (4, 1) and staged["a"].storage_offset() == 2
    assert _saved(staged)[1] == _saved(state)[1]  # the same file size: the same storages
    flat.zero_()
    assert staged["a"].tolist() == [2.0, 3.0, 4.0]


def test_a_modules_state_dict_keeps_its_versions_and_containers_their_types() -> None:
    state = nn.BatchNorm1d(3).state_dict()
    nested = {"bn": state, "list": [1, (2, 3)], "none": None}
    staged, _ = stage(nested)
    assert isinstance(staged["bn"], OrderedDict)
    assert staged["bn"]._metadata == state._metadata  # type: ignore[attr-defined]
    assert staged["list"] == [1, (2, 3)] and staged["none"] is None


def test_the_next_copy_reuses_the_last_ones_memory_where_the_sizes_fit() -> None:
    state = {"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.float64)}
    first = Stager(pin=False)
    first.copy(state)
    addresses = sorted(b.data_ptr() for b in first.buffers)
    state["a"].add_(10)
    state["c"] = torch.zeros(5)  # a size the pool has no buffer for: new memory
    second = Stager(pin=False, pool=first.buffers)
    copied = second.copy(state)
    reused = sorted(b.data_ptr() for b in second.buffers if b.data_ptr() in addresses)
    assert reused == addresses and len(second.buffers) == 3
    assert copied["a"].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert copied["b"].dtype == torch.float64 and copied["b"].shape == (2, 3)


class _Saves(TrainerCallback):
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass


class _Logs(TrainerCallback):
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass


def test_a_callback_of_its_own_on_save_is_heard_and_the_base_class_no_op_is_not() -> None:
    """A callback that acts on on_save makes the Trainer's saves synchronous (saving.py)."""

    def listens(*callbacks: Any) -> bool:
        handler = Callbacks.__new__(Callbacks)
        handler.callbacks = list(callbacks)
        return handler.listen_to("on_save")

    assert not listens(_Logs(), TrainerCallback())
    assert listens(_Logs(), _Saves())
