"""An optimizer made to step through a `Streamer` (stream.py): its class becomes a subclass
of its own whose `step` streams the state through files a window at a time and whose
`zero_grad` drops the file-backed gradients unwritten; the streamer rides on the
optimizer itself (`streamer_of`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from phalanx.offload.files import OffloadFiles
from phalanx.offload.stream import Streamer
from phalanx.runtime.hostmem import return_freed_memory

__all__ = ["stream_optimizer", "streamer_of"]

_STREAMER = "_phalanx_streamer"


def stream_optimizer(
    optimizer: Optimizer,
    files: OffloadFiles,
    window_bytes: int,
    group: dist.ProcessGroup | None = None,
) -> Streamer:
    """Make `optimizer.step()` stream its state through files (see the module doc); its
    class becomes a subclass of its own, so isinstance checks, hooks and schedulers hold."""
    existing = streamer_of(optimizer)
    if existing is not None:
        return existing
    return_freed_memory()  # offload is for less host memory: what a step frees goes back
    streamer = Streamer(optimizer, files, window_bytes, group)
    cls = type(optimizer)
    members = {"step": _streamed_step, "zero_grad": _zero_grad_of(cls)}
    streamed = type(f"Offloaded{cls.__name__}", (cls,), {**members, "__module__": cls.__module__})
    optimizer.__class__ = streamed
    optimizer._patch_step_function()  # hooks run around the whole step
    setattr(optimizer, _STREAMER, streamer)
    optimizer.register_load_state_dict_post_hook(lambda opt: streamer.adopt_all(opt))
    return streamer


def streamer_of(optimizer: Optimizer) -> Streamer | None:
    return getattr(optimizer, _STREAMER, None)


@torch.no_grad()
def _streamed_step(self: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    streamer = streamer_of(self)
    assert streamer is not None
    streamer.step(self)
    return loss


def _zero_grad_of(cls: type[Optimizer]) -> Callable[..., None]:
    def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
        """`cls`'s zero_grad, after dropping the file-backed gradients' pages: a gradient
        cleared is never read again, so writing it back (and reading it in before the next
        backward overwrites it) would be wasted I/O."""
        streamer = streamer_of(self)
        if streamer is not None:
            streamer.discard_grads(self)
        cls.zero_grad(self, set_to_none)

    return zero_grad
