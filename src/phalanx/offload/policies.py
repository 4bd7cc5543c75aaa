"""Where sharded state lives: the device (`OffloadPolicy()`), host memory
(`CPUOffloadPolicy`, FSDP2's) or files (`DiskOffloadPolicy`, phalanx's)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.offload.files import OffloadFiles

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
    """

    path: str = ""
    window_mb: float = 64.0
    params: bool = True
    _files: OffloadFiles | None = field(default=None, init=False, repr=False, compare=False)
    """This process's scratch directory for the policy's state: the policy owns it, so the
    units' shards, their gradients and the optimizer's state given this policy share it."""

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

    def files(self, what: str = "DiskOffloadPolicy.path") -> OffloadFiles:
        """The scratch directory, made at the first call (`what` names the setting in an
        error: an unwritable path fails here, before any step)."""
        if self._files is None or self._files.closed:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._files = OffloadFiles(self.path, rank, what)
        return self._files

    def close(self) -> None:
        """Remove the scratch directory (mappings stay valid until their tensors are freed);
        one more call of `files` makes a new one."""
        if self._files is not None:
            self._files.close()

    @property
    def window_bytes(self) -> int:
        return int(self.window_mb * 2**20)
