"""A background save's hold on offloaded tensors (offload/held.py): written from their files,
copied aside only when the next step gets there first, and a change behind the streamer's
back refused rather than written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from phalanx.errors import CheckpointError
from phalanx.offload.files import OffloadFiles
from phalanx.offload.held import SaveHold
from phalanx.train.checkpoint.staging import Stager


def _files(tmp_path: Path) -> OffloadFiles:
    return OffloadFiles(tmp_path, 0, "test")


def _held_ones(tmp_path: Path) -> tuple[OffloadFiles, torch.Tensor, SaveHold]:
    """Four ones in a file, held by a save."""
    files = _files(tmp_path)
    state = files.copy(torch.ones(4))
    hold = SaveHold(files.holds)
    hold.hold(state)
    return files, state, hold


def test_the_stager_holds_file_backed_tensors_and_copies_the_rest(tmp_path: Path) -> None:
    files = _files(tmp_path)
    in_file = files.copy(torch.arange(6.0))
    in_memory = torch.arange(4.0)
    hold = SaveHold(files.holds)
    stager = Stager(pin=False, hold=hold)
    staged = stager.copy({"a": in_file, "b": in_memory})
    assert staged["a"].data_ptr() == in_file.data_ptr()  # not copied: the writer reads the file
    assert staged["b"].data_ptr() != in_memory.data_ptr()
    assert stager.bytes == in_memory.nbytes
    assert hold.held_bytes == in_file.nbytes
    files.close()


def test_a_tensor_the_step_reaches_first_is_written_as_it_was(tmp_path: Path) -> None:
    files = _files(tmp_path)
    state = files.copy(torch.ones(8))
    view = state[2:6]
    hold = SaveHold(files.holds)
    hold.hold(state)
    hold.before_overwrite([state])  # the streamer, before its step
    state.mul_(3)  # the step
    assert hold.aside_bytes == state.nbytes
    with hold.reading(view) as values:
        assert values.tolist() == [1.0] * 4  # the step's values, the same view of them
    assert hold.aside_bytes == state.nbytes  # let go once read: the copy is gone
    with hold.reading(state) as values:  # written: the live tensor is given now
        assert values.tolist() == [3.0] * 8
    files.close()


def test_the_writer_holds_a_tensor_while_it_writes_it(tmp_path: Path) -> None:
    files = _files(tmp_path)
    state = files.copy(torch.ones(4))
    hold = SaveHold(files.holds, files.release)
    hold.hold(state)
    stepped = threading.Event()

    def step() -> None:
        hold.before_overwrite([state])  # waits for the writer's tensor, copies nothing
        state.add_(1)
        stepped.set()

    with hold.reading(state) as values:
        stepper = threading.Thread(target=step)
        stepper.start()
        assert not stepped.wait(0.2)  # a bound on a negative: the step cannot get in
        written = values.clone()
    stepper.join(30)
    assert stepped.is_set()
    assert written.tolist() == [1.0] * 4 and hold.aside_bytes == 0
    files.close()


def test_a_change_behind_the_streamers_back_fails_the_save(tmp_path: Path) -> None:
    files, state, hold = _held_ones(tmp_path)
    state.clamp_(max=0.5)  # a callback's in-place edit between steps
    hold.before_overwrite([state])  # the streamer does not copy what is already changed
    refused = pytest.raises(CheckpointError, match="changed in place while a background save")
    with refused, hold.reading(state):
        pass
    files.close()


def test_a_closed_hold_keeps_nothing(tmp_path: Path) -> None:
    files, state, hold = _held_ones(tmp_path)
    hold.close()
    hold.before_overwrite([state])
    assert hold.aside_bytes == 0
    files.close()
