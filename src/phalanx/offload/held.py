"""Offloaded tensors a background save writes from their files, with no copy at the step.

A background checkpoint copies the state at the step boundary so that training can
go on while the copy is written (train/checkpoint/staging.py). Offloaded state needs
no copy to stay still: it is already in files, and nothing changes it until the
optimizer's next step writes it, a window at a time (stream.py). So a save *holds*
the file-backed tensors instead (`SaveHold.hold`): its writer reads each one where it
lies, and the streamer, before it overwrites a window, copies aside what the writer
has not yet written (`before_overwrite`: on the read thread once it has read the
window in, and again on the training thread just before the window's step). The
writer then writes the copy. Nothing is copied at the step boundary (the stall of a
copy of the whole state out of the files), and only what the next step reaches before
the writer does is copied at all; DeepSpeed#7549 (a checkpoint copied from offloaded
state that the next step was writing) is what the order rules out.

One lock covers the hold: the writer holds it while it writes one tensor, and a
window's step waits for that tensor rather than copy it. Anything else that writes a
held tensor in place (a callback's `p.data.clamp_()` between steps) would go
unnoticed by the streamer: the writer compares each tensor's version counter (torch
bumps it at every in-place write) with the one it had at the step, and fails the
save in one line rather than write a tensor of two steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from phalanx.errors import CheckpointError

__all__ = ["SaveHold"]


@dataclass
class _Held:
    tensor: torch.Tensor
    version: int
    aside: torch.Tensor | None = None
    """The step's bytes of the tensor's whole storage, copied before the next step overwrote
    them."""
    uses: int = 0
    """How many entries of the staged state are this tensor's storage (a tied weight's two):
    each is read once; the last read lets the copy aside go."""
    written: bool = False
    changed: bool = False
    """Written in place by something other than the streamer before the writer got to it."""


class SaveHold:
    """The file-backed tensors of one background save (module docstring)."""

    def __init__(
        self,
        in_files: Callable[[torch.Tensor], bool],
        drop_pages: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self._in_files = in_files
        self._drop_pages = drop_pages
        """Once written from its file: its pages let go (the write read them in)."""
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self.held_bytes = 0
        """Bytes held in their files at the step (not copied then)."""
        self.aside_bytes = 0
        """Of which the next step reached first, copied aside before it overwrote them."""
        self.closed = False

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in a file this hold can keep still."""
        return tensor.device.type == "cpu" and self._in_files(tensor)

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep `tensor`'s values of now for the writer; `tensor` itself, for the staged state."""
        key = _key(tensor)
        with self._lock:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _Held(tensor, tensor._version)
                self.held_bytes += tensor.untyped_storage().nbytes()
            held.uses += 1
        return tensor

    def before_overwrite(self, tensors: list[torch.Tensor]) -> None:
        """The streamer is about to write `tensors`: copy aside those the writer still needs."""
        if self.closed:
            return
        with self._lock:
            for tensor in tensors:
                held = self._held.get(_key(tensor))
                if held is None or held.written or held.aside is not None or held.changed:
                    continue
                if held.tensor._version != held.version:  # the writer says so: not the step
                    held.changed = True
                    continue
                held.aside = _storage_copy(held.tensor)
                self.aside_bytes += held.aside.nbytes

    @contextmanager
    def reading(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """The step's values of `tensor` (the live tensor, or its copy aside), still while the
        block runs; the writer has written this entry of it after (at its last entry, its
        copy is let go and its pages dropped). A tensor this save does not hold, or holds no
        more, is given as it is."""
        with self._lock:
            held = self._held.get(_key(tensor))
            if held is None or held.written:
                yield tensor
                return
            live = held.aside is None
            if live:
                if held.changed or held.tensor._version != held.version:
                    raise _changed(held.tensor)
                yield tensor
            else:
                assert held.aside is not None
                yield _view_in(held.aside, tensor)
            held.uses -= 1
            if held.uses <= 0:
                held.written, held.aside = True, None
                if live and self._drop_pages is not None:
                    self._drop_pages([held.tensor])

    @contextmanager
    def still(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """While the block runs, the function it is given maps a tensor to its step's values
        (its copy aside, or itself, kept still: the streamer's next window waits)."""
        with self._lock:
            yield self._of_the_step

    def _of_the_step(self, tensor: torch.Tensor) -> torch.Tensor:
        held = self._held.get(_key(tensor))
        if held is None or held.aside is None:
            return tensor
        return _view_in(held.aside, tensor)

    def close(self) -> None:
        """The save is over (written, or failed): nothing is held any more."""
        with self._lock:
            self.closed = True
            self._held.clear()


def _changed(tensor: torch.Tensor) -> CheckpointError:
    return CheckpointError(
        f"an offloaded tensor of shape {tuple(tensor.shape)} was changed in place while a "
        "background save was writing it, by something other than the optimizer's step (a "
        "callback?) — change parameters only in the optimizer's step, or set save_async=False"
    )


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _storage_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`'s whole storage, as bytes."""
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return raw.clone()


def _view_in(storage_copy: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """`view` (of a held tensor's storage) as the same view of the storage's copy."""
    out = torch.empty(0, dtype=view.dtype)
    storage = storage_copy.untyped_storage()
    return out.set_(storage, view.storage_offset(), view.size(), view.stride())
