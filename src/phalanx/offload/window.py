"""What a streamed step (stream.py) goes through: a window's file-backed tensors, and what
the offloaded steps cost in I/O."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from phalanx.offload.direct import DirectEntry, DirectWindow
from phalanx.offload.fused import local

__all__ = ["IOStats", "Window"]


@dataclass
class IOStats:
    """What the offloaded steps cost: bytes through the files, and the step's waits."""

    read_bytes: int = 0
    written_bytes: int = 0
    direct_bytes: int = 0
    """Of those read and written, the bytes moved by O_DIRECT (direct.py)."""
    io_s: float = 0.0
    """Time the I/O threads spent reading and writing."""
    read_s: float = 0.0
    """Of which reading (faulting the next window's pages in)."""
    wait_s: float = 0.0
    """Time the training thread waited for a window's pages (the exposed I/O)."""
    step_s: float = 0.0
    """Wall time of the offloaded optimizer steps."""


@dataclass
class Window:
    """One window's file-backed tensors, and its reads in flight."""

    params: list[list[torch.Tensor]]
    """Each group's members in it."""
    written: list[torch.Tensor]
    """Written through their mappings: the parameters, and state where O_DIRECT is off."""
    read: list[torch.Tensor]
    """Only read: the gradients."""
    direct: list[DirectEntry]
    """State moved by O_DIRECT (direct.py)."""
    buffer: DirectWindow | None = None
    """Where `direct` is read to and stepped, once its read has begun."""
    reads: list[Future[None]] = field(default_factory=list)

    def held(self) -> list[torch.Tensor]:
        """Every file-backed tensor the step overwrites: a save in flight keeps them."""
        return self.written + [local(e.value) for e in self.direct]

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        return self.buffer.stepping() if self.buffer is not None else contextlib.nullcontext()
