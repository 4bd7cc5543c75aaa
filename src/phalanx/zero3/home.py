"""Where a unit's sharded parameters and their gradients live: the device, host memory, or files.

The offload policy picks the home; the unit computes on the mesh's device
either way. A shard away from the device is copied there by its unit's
all-gather (the gather's input is built on the device), and the reduced
gradient rows are copied back into a gradient buffer kept at home for each
parameter, made once, so a step allocates nothing there.
"""

from __future__ import annotations

import torch

from phalanx.offload.files import OffloadFiles, write_at
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.zero3.policies import CPUOffloadPolicy, DiskOffloadPolicy, OffloadPolicy


class Home:
    """The device itself: shards are made where the mesh computes."""

    away = False
    """Whether shards live somewhere other than the compute device."""
    in_files = False
    """Whether shards live in files (an allocation can then fail on one rank: a full disk),
    made whole when the unit is: so a full disk shows at setup, not in a backward."""

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A home for a gradient shard; None: the reduce-scatter's output serves as one."""
        return None

    def keep(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (a new shard, possibly on the device) as it lives at home."""
        return local

    def store(self, home: torch.Tensor, value: torch.Tensor) -> None:
        """`value`'s elements into `home` (a tensor of this home: a gradient's buffer)."""
        home.copy_(value.view(home.shape))

    def settle(self, tensors: list[torch.Tensor]) -> None:
        """Done with these tensors until the optimizer step: nothing to do in memory."""


class HostHome(Home):
    """CPUOffloadPolicy: host memory, pinned for the copies when the device is not the CPU."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.away = device.type != "cpu"
        self.pin = pin and self.away

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.away:
            return None
        return torch.zeros(shape, dtype=dtype, pin_memory=self.pin)

    def keep(self, local: torch.Tensor) -> torch.Tensor:
        if not self.away or local.is_meta or local.device.type == "cpu":
            return local
        host = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin)
        host.copy_(local)
        return host


class FileHome(Home):
    """DiskOffloadPolicy: one file per shard and per gradient shard, in this process's
    scratch directory under the policy's path."""

    away = True
    in_files = True

    def __init__(self, files: OffloadFiles) -> None:
        self.files = files

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        return self.files.tensor(shape, dtype)

    def keep(self, local: torch.Tensor) -> torch.Tensor:
        """`local` in a file, whose pages then leave this process (as `settle`): kept
        mapped, every shard written at setup stayed resident until its first gather."""
        if local.is_meta or self.files.holds(local):
            return local
        copy = self.files.copy(local)
        self.files.forget([copy])
        return copy

    def store(self, home: torch.Tensor, value: torch.Tensor) -> None:
        """Written into `home`'s file, not through its mapping: the bytes reach the kernel's
        cache without a page fault each 4 KB on the training thread (docs/zero.md,
        "Offload")."""
        if value.dtype != home.dtype or self.files.path_of(home) is None:
            super().store(home, value)  # not a whole file of its own: through the mapping
            return
        with self.files.through_file(home) as fd:
            write_at(fd, value.reshape(-1).contiguous(), 0)

    def settle(self, tensors: list[torch.Tensor]) -> None:
        """Unmap these file pages from this process once read (a shard, copied into its
        gather) or written (a gradient shard): the kernel's cache keeps them, clean pages
        free to reclaim, until the optimizer step maps them again. Left mapped, every
        shard and gradient a step touched stayed resident until that step: a disk offload
        of the shards saved no resident memory without a memory limit to force it out
        (benchmarks/offload_fraction.py, docs/zero.md "Fractional offload")."""
        self.files.forget(tensors)


def homes_of(policy: OffloadPolicy, device: torch.device, params: list[torch.Tensor]) -> list[Home]:
    """Each parameter's home: a fractional disk offload (DiskOffloadPolicy(fraction < 1))
    keeps some shards in memory, the ones its plan leaves out (a unit sharded alone, with
    no plan of the whole model covering it, is planned on its own)."""
    home = home_of(policy, device)
    if not isinstance(policy, DiskOffloadPolicy) or not isinstance(home, FileHome):
        return [home] * len(params)
    if any(policy.shard_in_files(p) is None for p in params):
        policy.plan(params)
    in_memory = Home()
    return [home if policy.shard_in_files(p) else in_memory for p in params]


def home_of(policy: OffloadPolicy, device: torch.device) -> Home:
    """The home `policy` names. Under disk offload, host memory freed from now on goes back to
    the kernel (runtime/hostmem.py): the point of that policy is less of it, and the units'
    whole buffers, freed every step, would otherwise stay resident (docs/zero.md, "Offload",
    measured). CPUOffloadPolicy, FSDP2's, keeps glibc's default, as torch does."""
    if isinstance(policy, DiskOffloadPolicy):
        return_freed_memory()
        if not policy.params:
            return Home()
        return FileHome(policy.files())
    if isinstance(policy, CPUOffloadPolicy):
        return HostHome(device, policy.pin_memory)
    return Home()
