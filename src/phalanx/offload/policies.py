"""Where sharded state lives: the device (`OffloadPolicy()`), host memory
(`CPUOffloadPolicy`, FSDP2's) or files (`DiskOffloadPolicy`, phalanx's)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.offload import direct
from phalanx.offload.files import OffloadFiles
from phalanx.offload.fraction import Order, largest_first, shard_share, state_share

__all__ = ["CPUOffloadPolicy", "DiskOffloadPolicy", "OffloadPolicy"]


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients in host memory, the optimizer steps there (FSDP2).

    Each unit's gather copies its shards to the device just before use, and
    its reduced gradients come back to host memory; on a CPU mesh, where both
    already are, it changes nothing."""

    pin_memory: bool = True


@dataclass
class DiskOffloadPolicy(OffloadPolicy):
    """Sharded state in files under `path` (ZeRO-Infinity's idea; phalanx's own policy).

    At stage 3 (`fully_shard(offload_policy=...)`) the sharded parameters and
    their gradients live in files, unless `params=False`; the optimizer state
    does once the optimizer is streamed (`phalanx.offload_optimizer`, or
    `ZeroRedundancyOptimizer(offload_policy=...)` at stages 1-2). Its step then
    goes through about `window_mb` of state at a time. The files are scratch: a
    fresh directory per process under `path`, removed at a clean exit.

    `fraction` < 1 puts only that share of the offloadable bytes in files and keeps
    the rest in memory, `order` deciding which go first ("coldest": the optimizer
    state, then the shards; "largest": whole parameters, largest first; see
    offload/fraction.py and docs/zero.md, "Fractional offload"). At stage 3 the
    shards' part is chosen over the whole model when `zero3.shard_model` (or the
    Trainer) shards it; a unit sharded on its own with `fully_shard` is planned alone.
    """

    path: str = ""
    window_mb: float = 64.0
    params: bool = True
    fraction: float = 1.0
    order: Order = "coldest"
    direct: bool | None = None
    """Move the optimizer's state by O_DIRECT in its step (offload/direct.py): None where the
    filesystem takes it (not tmpfs), False never (mappings throughout), True or an error."""
    _files: OffloadFiles | None = field(default=None, init=False, repr=False, compare=False)
    """This process's scratch directory for the policy's state: the policy owns it, so the
    units' shards, their gradients and the optimizer's state given this policy share it."""
    _planned: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """For each parameter planned (by id, with a weak reference that tells a reused id):
    whether its shard goes to files."""

    def __post_init__(self) -> None:
        if not str(self.path):
            raise ConfigurationError(
                "DiskOffloadPolicy needs path= (a directory on a local disk for the "
                "offloaded state), e.g. DiskOffloadPolicy(path='/nvme/offload')"
            )
        if not self.window_mb > 0:
            raise ConfigurationError(
                f"DiskOffloadPolicy(window_mb={self.window_mb}) must be positive — it is how "
                "much state the optimizer step holds in memory at a time (e.g. 64)"
            )
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigurationError(
                f"DiskOffloadPolicy(fraction={self.fraction}) must be in [0, 1] — the share "
                "of the offloadable state kept in files (1: all of it, 0: none)"
            )
        if self.order not in ("coldest", "largest"):
            raise ConfigurationError(
                f"DiskOffloadPolicy(order={self.order!r}) must be 'coldest' (the optimizer "
                "state first) or 'largest' (whole parameters, largest first)"
            )

    def plan(self, params: Iterable[torch.Tensor]) -> None:
        """Choose which of `params` (a whole model's, before it is sharded; meta ones
        included) keep their shards in files: the largest, up to the shards' share of
        `fraction`. Every rank, given the same model, chooses the same."""
        unique = list({id(p): p for p in params}.values())
        sizes = [(id(p), p.numel() * p.element_size()) for p in unique]
        chosen = largest_first(sizes, shard_share(self.fraction, self.order))
        for p in unique:
            self._planned[id(p)] = (weakref.ref(p), id(p) in chosen)

    def shard_in_files(self, param: torch.Tensor) -> bool | None:
        """Whether `param`'s shard goes to files; None if no plan covers it."""
        if not self.params:
            return False
        if self.fraction >= 1.0:
            return True
        entry = self._planned.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def state_share(self, shards_offloadable: bool) -> float:
        """The share of the optimizer state's bytes in files (`shards_offloadable`: stage 3,
        where the shards take part of `fraction`)."""
        return state_share(self.fraction, self.order, shards_offloadable and self.params)

    def files(self, what: str = "DiskOffloadPolicy.path") -> OffloadFiles:
        """The scratch directory, made at the first call (`what` names the setting in an
        error: an unwritable path fails here, before any step)."""
        if self._files is None or self._files.closed:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._files = OffloadFiles(self.path, rank, what)
            works = self.direct is not False and direct.supported(self._files.directory)
            if self.direct and not works:
                self._files.close()
                raise ConfigurationError(
                    f"DiskOffloadPolicy(direct=True): the filesystem of {self.path} refuses "
                    "O_DIRECT (tmpfs?) — point path at a local disk, or leave direct=None "
                    "to step through mappings where O_DIRECT is refused"
                )
            self._files.direct = works
        return self._files

    def close(self) -> None:
        """Remove the scratch directory (mappings stay valid until their tensors are freed);
        one more call of `files` makes a new one."""
        if self._files is not None:
            self._files.close()

    @property
    def window_bytes(self) -> int:
        return int(self.window_mb * 2**20)
