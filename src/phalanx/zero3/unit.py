"""A unit's parameters: pieces kept, the whole gathered on demand, gradients scattered.

A unit flattens its parameters, per (device, compute dtype), into one
`FlatGroup`: the full parameters are views into a single buffer whose
storage is freed (resized to nothing) whenever the unit is not computing,
and refilled by one all-gather of every rank's pieces when it is. After the
unit's backward, its gradients go out in one reduce-scatter, and each rank
keeps (adds to its piece's `.grad`) only its own share.

The data is written into the full parameters through separate aliases of
the same storage, so refilling them between forward and backward does not
bump the version counter that autograd checks on the tensors it saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.optim.sharding import ShardedFlat, all_gather_flat, piece_of, reduce_scatter_flat
from phalanx.zero3.params import ShardParameter, make_shard


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's names: compute in `param_dtype`, reduce gradients in `reduce_dtype`.

    None keeps the parameter's own dtype. The pieces the optimizer steps stay in
    the parameter's dtype (fp32 master weights under a bf16 policy).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class UnitStats:
    """Where a unit's communication time went: waits are time the training thread was blocked."""

    gathers: int = 0
    gather_wait_s: float = 0.0
    """Blocked waiting for an all-gather: what prefetching did not hide."""
    reduces: int = 0
    reduce_wait_s: float = 0.0
    """Blocked at the end of backward waiting for a reduce-scatter."""


@dataclass(frozen=True)
class Slot:
    """Where a parameter is registered (several places when tied), and its two faces."""

    owners: tuple[tuple[nn.Module, str], ...]
    shard: ShardParameter
    full: nn.Parameter

    def register(self, face: nn.Parameter) -> None:
        for owner, name in self.owners:
            owner._parameters[name] = face


@dataclass(frozen=True)
class Managed:
    """A parameter a unit takes over: its qualified name and every place it is registered."""

    param: nn.Parameter
    fqn: str
    owners: tuple[tuple[nn.Module, str], ...]


class FlatGroup:
    """The parameters of one unit that share a device and a compute dtype."""

    def __init__(self, slots: list[Slot], group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        self.slots = slots
        self.group = group
        self.world_size = dist.get_world_size(group)
        fulls = [s.full for s in slots]
        self.layout = ShardedFlat.of(fulls, self.world_size, dist.get_rank(group))
        self.dtype = dtype
        self._storage = fulls[0].untyped_storage()
        self._nbytes = self._storage.nbytes()
        # Aliases of the same storage with their own version counters (see the module doc).
        self._writers = [
            torch.empty(0, dtype=dtype, device=f.device).set_(
                self._storage, f.storage_offset(), f.shape, f.stride()
            )
            for f in fulls
        ]
        self._gather: tuple[Any, torch.Tensor] | None = None
        self.stats = UnitStats()

    @property
    def full_bytes(self) -> int:
        return self._nbytes

    def free(self) -> None:
        self._storage.resize_(0)

    def start_gather(self) -> None:
        """Issue the all-gather of every rank's pieces (it runs while other work goes on)."""
        if self._gather is not None:
            return
        with torch.no_grad():
            pieces = [s.shard.detach().to(self.dtype) for s in self.slots]
            block = self.layout.own_block_input(pieces)
            out = block.new_empty(self.world_size * self.layout.block)
            work = all_gather_flat(out, block, self.group, async_op=True)
        self._gather = (work, out)

    def finish_gather(self) -> None:
        """Wait for the all-gather and write the whole parameters into their storage."""
        self.start_gather()
        assert self._gather is not None
        work, out = self._gather
        self._gather = None
        start = time.perf_counter()
        work.wait()
        self.stats.gather_wait_s += time.perf_counter() - start
        self.stats.gathers += 1
        if self._storage.nbytes() != self._nbytes:
            self._storage.resize_(self._nbytes)
        with torch.no_grad():
            self.layout.copy_out(out, self._writers)

    def start_reduce(self, reduce_dtype: torch.dtype | None) -> Any:
        """Average the full gradients into the owners' pieces with one async reduce-scatter."""
        dtype = reduce_dtype or self.slots[0].shard.dtype
        with torch.no_grad():
            grads = [None if s.full.grad is None else s.full.grad.to(dtype) for s in self.slots]
            if all(g is None for g in grads):
                return None
            send = self.layout.reduce_scatter_input(grads).to(dtype)
            send.div_(self.world_size)
        for s in self.slots:
            s.full.grad = None
        out = send.new_empty(self.layout.block)
        work = reduce_scatter_flat(out, send, self.group, async_op=True)
        return work, out, send

    def finish_reduce(self, handle: Any) -> None:
        if handle is None:
            return
        work, out, _send = handle
        start = time.perf_counter()
        work.wait()
        self.stats.reduce_wait_s += time.perf_counter() - start
        self.stats.reduces += 1
        with torch.no_grad():
            for slot, piece in zip(self.slots, self.layout.piece_views(out)):
                if not slot.shard.requires_grad:
                    continue
                piece = piece.to(slot.shard.dtype)
                if slot.shard.grad is None:
                    slot.shard.grad = piece  # a view of the output: 1/N of the group, no copy
                else:  # a second backward before the step accumulates, as .grad would
                    slot.shard.grad.add_(piece)


def compute_dtype(m: Managed, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The policy's dtype, except for modules that keep floating buffers (BatchNorm's running
    statistics): their kernels need parameters and buffers of one dtype, so they stay as is."""
    if policy.param_dtype is None or not m.param.is_floating_point():
        return m.param.dtype
    for owner, _ in m.owners:
        if any(b.is_floating_point() for b in owner.buffers(recurse=False)):
            return m.param.dtype
    return policy.param_dtype


def build_groups(
    managed: list[Managed], group: dist.ProcessGroup, policy: MixedPrecisionPolicy
) -> list[FlatGroup]:
    """Cut each parameter into its piece and give it a full face in its group's flat buffer."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    by_key: dict[tuple[torch.device, torch.dtype], list[Managed]] = {}
    for m in managed:
        by_key.setdefault((m.param.device, compute_dtype(m, policy)), []).append(m)
    groups = []
    for (device, dtype), members in by_key.items():
        flat = torch.empty(sum(m.param.numel() for m in members), dtype=dtype, device=device)
        slots, offset = [], 0
        for m in members:
            piece = piece_of(m.param.numel(), world_size, rank)
            shard = make_shard(m.param, piece, m.fqn)
            view = flat[offset : offset + m.param.numel()].view(m.param.shape)
            full = nn.Parameter(view, requires_grad=m.param.requires_grad)
            slots.append(Slot(m.owners, shard, full))
            offset += m.param.numel()
        groups.append(FlatGroup(slots, group, dtype))
    return groups
