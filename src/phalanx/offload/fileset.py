"""Every scratch directory a streamed optimizer's tensors live in.

Its own (`OffloadFiles`: the state it makes goes there) and any that hold its
parameters' shards and gradients: a model sharded with a `DiskOffloadPolicy` of
its own before the Trainer was given it keeps them in that policy's directory.
The streamer reads, writes back and drops a window's tensors through whichever
holds each, and a background save holds them all still (held.py): a tensor in
another directory counted as in memory was copied whole at every save, the
whole model's shards at once (the 375M MLP under a 700 MB cap: killed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from phalanx.offload.files import OffloadFiles

__all__ = ["FileSet"]


class FileSet:
    """The optimizer's own files first, then the others that hold its parameters."""

    def __init__(self, own: OffloadFiles) -> None:
        self.members: list[OffloadFiles] = [own]

    def add(self, files: OffloadFiles) -> None:
        if all(files is not m for m in self.members):
            self.members.append(files)

    def owner(self, tensor: torch.Tensor) -> OffloadFiles | None:
        return next((m for m in self.members if m.holds(tensor)), None)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.owner(tensor) is not None

    def direct_path(self, tensor: torch.Tensor) -> Path | None:
        """The file `tensor` spans whole, where its files move it by O_DIRECT; else None."""
        files = self.owner(tensor)
        return files.path_of(tensor) if files is not None and files.direct else None

    def populate(self, tensors: list[torch.Tensor], writable: bool = False) -> None:
        self._each(tensors, lambda files, mine: files.populate(mine, writable))

    def release(self, tensors: list[torch.Tensor]) -> None:
        self._each(tensors, lambda files, mine: files.release(mine))

    def forget(self, tensors: list[torch.Tensor]) -> None:
        self._each(tensors, lambda files, mine: files.forget(mine))

    def discard(self, tensors: list[torch.Tensor]) -> None:
        self._each(tensors, lambda files, mine: files.discard(mine))

    def discardable(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `tensors` whose files can drop pages unwritten (files.py, `discard`)."""
        return [t for t in tensors if (f := self.owner(t)) is not None and f.can_discard]

    def _each(
        self,
        tensors: list[torch.Tensor],
        act: Callable[[OffloadFiles, list[torch.Tensor]], None],
    ) -> None:
        """`act` once per member over the tensors it holds (the rest are not in files)."""
        if len(self.members) == 1:
            act(self.members[0], tensors)  # its own calls skip what it does not hold
            return
        for files in self.members:
            mine = [t for t in tensors if files.holds(t)]
            if mine:
                act(files, mine)
