"""`Root`: the outermost unit's view of the whole model.

The first unit whose forward runs is the root (FSDP2's rule): it finds every
unit in its module, settles their defaults (`reshard_after_forward=None` is
False for the root, True for the others), records the order units run in
(for prefetching), broadcasts rank 0's buffers before a forward with DDP's
exact rule, and at the end of backward finishes every unit's reduction and
frees what is left.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.diagnostics import timeline as timelines
from phalanx.errors import ConfigurationError
from phalanx.parallel.autograd import EndOfBackward
from phalanx.parallel.sync import broadcast_coalesced
from phalanx.parallel.traffic import TrafficCounter
from phalanx.runtime.nested import iter_tensors
from phalanx.zero3.group import ParamGroup, PendingAllReduce
from phalanx.zero3.unit import Unit, UnitPhase

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline

STATE = "_phalanx_unit"


def unit_of(module: nn.Module) -> Unit | None:
    return getattr(module, STATE, None)


class Root:
    """Order, buffers and the end of backward for every unit under the root module."""

    def __init__(self, unit: Unit) -> None:
        if len(unit.modules) > 1:
            names = ", ".join(type(m).__name__ for m in unit.modules)
            raise ConfigurationError(
                f"the first forward ran through the fully_shard group [{names}]: a root is one "
                "module — fully_shard the model that contains them last, and run its forward"
            )
        self.unit = unit
        self.units = self._claim_units()
        prefixes = {id(m): n for n, m in unit.module.named_modules(remove_duplicate=False)}
        for u in self.units:
            for p in u.params:  # names relative to the whole model now
                owner, pname = p.owners[0]
                prefix = prefixes.get(id(owner), "")
                p.fqn = f"{prefix}.{pname}" if prefix else pname
        self.order: list[Unit] = []
        self.recording = True
        self._end = EndOfBackward(self.end_of_backward)
        self.comm = TrafficCounter()
        """The buffer broadcasts (the units count their own gathers and reductions)."""
        self.timeline: Timeline | None = unit.timeline or timelines.from_env(
            dist.get_rank(), dist.get_world_size()
        )
        for u in self.units:
            u.record_to(self.timeline)
        self._in_flight: list[Unit] = []
        """The units whose reduce-scatters went out last, oldest first: a launch finishes the
        oldest past `set_reduce_scatter_max_input_buffers` (1: FSDP2's rule), so that many
        units' whole-size gradient buffers are alive at a time, not all."""
        self._all_reduces: list[tuple[ParamGroup, PendingAllReduce]] = []
        self._forward_span: AbstractContextManager[None] | None = None
        self._backward_start = 0
        # DDP's rule, kept for parity with it: buffers follow rank 0 before the first forward
        # and before any forward that follows a gradient-tracked one.
        self._broadcast_next = True

    def _claim_units(self) -> list[Unit]:
        """Every unit in the root's module, once each (a group's modules share one, named
        by all of them), in pre-order; each settles its reshard_after_forward default."""
        units: list[Unit] = []
        names_of: dict[int, list[str]] = {}
        for name, module in self.unit.module.named_modules():
            u = unit_of(module)
            if u is None:
                continue
            if id(u) in names_of:  # a group's next module
                names_of[id(u)].append(name)
                continue
            if u.root is not None:
                raise ConfigurationError(
                    f"the fully_shard unit '{name}' already ran a forward of its own, before "
                    f"{type(self.unit.module).__name__} — run the forward through the root "
                    "module (the module fully_shard was applied to last) from the first step"
                )
            u.root = self
            names_of[id(u)] = [name]
            if u.reshard_after_forward is None:
                u.reshard_after_forward = u is not self.unit
            units.append(u)
        for u in units:
            u.name = ", ".join(names_of[id(u)])
        return units

    def begin_forward(self, args: Any, kwargs: Any) -> None:
        if self.recording and self.order:
            self.recording = False
        if self.timeline is not None and torch.is_grad_enabled():
            first = next(iter_tensors((args, kwargs)), None)
            samples = int(first.shape[0]) if first is not None and first.dim() else 1
            self._forward_span = self.timeline.forward(samples)
            self._forward_span.__enter__()
        broadcast, self._broadcast_next = self._broadcast_next, torch.is_grad_enabled()
        if broadcast and self.unit.broadcast_buffers:
            buffers = list(self.unit.module.buffers())
            # Every rank of the mesh holds the buffers whole: the 1-D mesh's group, or (HSDP)
            # the default group, which a 2-D data-parallel mesh spans.
            mesh = self.unit.info.mesh
            group = mesh.get_group(0) if mesh.ndim == 1 else dist.group.WORLD
            assert group is not None
            if buffers and dist.get_world_size(group) > 1:
                self.comm.add(broadcast_coalesced(buffers, group))

    def abandon(self) -> None:
        """Forget an iteration whose group is gone (live recovery, before a re-deal): its
        collectives failed with that group, so nothing is waited for. Every unit goes back
        to idle and sharded, and the end of backward may be queued again. Left as it was,
        a rank cut off in forward and one cut off in backward began the next iteration in
        different phases, and their gathers no longer paired up (a size mismatch, or a
        hang: benchmarks/live_goodput.py --zero-stage 3)."""
        for u in self.units:
            u.reducing = None
            u.end_iteration()
            u.reshard()
        self._all_reduces, self._in_flight = [], []
        self._end = EndOfBackward(self.end_of_backward)
        self._forward_span = None

    def record_again(self) -> None:
        """Forget the order units ran in: the next iteration records it again, prefetching
        nothing (after a re-deal every rank must issue the same gathers, and a replacement
        has recorded nothing yet)."""
        self.order, self.recording = [], True
        self._broadcast_next = True

    def record(self, unit: Unit) -> None:
        if self.recording and unit not in self.order:
            self.order.append(unit)

    def next_after(self, unit: Unit, step: int) -> Unit | None:
        """The unit `step` places after `unit` in forward order (-1: the one before it)."""
        if self.recording or unit not in self.order:
            return None
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def end_forward(self) -> None:
        if self._forward_span is not None:
            span, self._forward_span = self._forward_span, None
            span.__exit__(None, None, None)

    def queue_end_of_backward(self) -> None:
        """Called from the first unit backward hook, which fires in the outermost backward."""
        if not self._end.queued and self.timeline is not None:
            self.timeline.backward_started()
        self._end.queue()

    def reduce_launched(self, unit: Unit) -> None:
        """`unit`'s reduce-scatter is out: finish the oldest in flight past the cap, which
        have had `unit`'s whole backward to arrive (HSDP's all-reduces go on, block-sized).
        The cap is the largest any unit asks for (FSDP2 keeps one for all units too)."""
        cap = max(u.reduce_buffers for u in self.units)
        if unit not in self._in_flight:
            self._in_flight.append(unit)
        while len(self._in_flight) > cap:
            self._all_reduces += self._in_flight.pop(0).finish_reduce()

    def end_of_backward(self) -> None:
        """Every unit's gradients reduced into the shards; every unit freed."""
        if self.timeline is not None:  # its waits are booked one by one (comm_waited)
            now = time.perf_counter_ns()
            self.timeline.backward_waited(now, now)
        for u in self.units:
            if not u.requires_gradient_sync:
                u.hold_unsynced()  # a unit some of whose parameters went unused, unsynced
            elif u.arrived and u.reducing is None and not u.reduced:
                u.launch_reduce()  # a unit some of whose parameters went unused
        pending = self._all_reduces + [entry for u in self.units for entry in u.finish_reduce()]
        self._all_reduces, self._in_flight = [], []
        for group, all_reduce in pending:
            group.finish_all_reduce(all_reduce)
        for u in self.units:
            u.end_iteration()

    def reset(self) -> None:
        """After a forward or backward that raised: nothing in flight, everything sharded."""
        for u in self.units:
            for _, state in u.reducing or []:
                state.work.wait()
            u.reducing = None
            u.reduced = False
            u.arrived = 0
            u.to_run.clear()
        for _, pending in self._all_reduces:
            pending.work.wait()
        self._all_reduces, self._in_flight = [], []
        for u in self.units:
            u.phase = UnitPhase.IDLE
            u.reshard()
