"""`fully_shard(module)`: ZeRO stage 3, applied to each block and then to the root (FSDP2's style).

Each call makes `module` a *unit*: its parameters (those not already in a
unit below it) are cut into pieces, one per rank, and the module keeps only
this rank's pieces (`ShardParameter`s, which the optimizer steps). Around
the unit's forward the whole parameters are gathered and then freed again;
before its backward they are gathered once more, and after it their
gradients are reduce-scattered into the pieces' `.grad` and freed. While a
unit computes, the next one's all-gather is already in flight (the order is
recorded in the first forward).

The outermost unit that runs a forward is the *root*: it broadcasts rank
0's buffers before each forward (as DDP does), and at the end of backward
waits for every reduce-scatter and frees everything.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from phalanx.ddp.autograd import EndOfBackward
from phalanx.ddp.sync import broadcast_coalesced, verify_same_state
from phalanx.errors import ConfigurationError
from phalanx.nested import iter_tensors, map_tensors
from phalanx.zero3.params import ShardParameter
from phalanx.zero3.unit import FlatGroup, Managed, MixedPrecisionPolicy, build_groups

_STATE = "_phalanx_unit"
# Which unit cut each original parameter: a parameter still registered whole somewhere
# else (tied weights) must not be cut a second time by another unit. Weak: it keeps no
# parameter alive, and a parameter no module holds any more drops out by itself.
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys.
_CUT_BY: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}


class Unit:
    """One fully_shard module: its flat groups, and where it stands in this iteration."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatGroup],
        group: dist.ProcessGroup,
        policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        broadcast_buffers: bool,
    ) -> None:
        self.module = module
        self.groups = groups
        self.process_group = group
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.broadcast_buffers = broadcast_buffers
        self.root: Root | None = None
        self.gathered = False
        self.expected = sum(s.full.requires_grad for g in groups for s in g.slots)
        self.arrived = 0
        self.reducing: list[tuple[FlatGroup, Any]] | None = None
        for g in groups:
            for slot in g.slots:
                if slot.full.requires_grad:
                    slot.full.register_post_accumulate_grad_hook(self._on_full_grad)

    def slots(self) -> Iterator[Any]:
        for g in self.groups:
            yield from g.slots

    # ---------------------------------------------------------------- faces
    def unshard(self) -> None:
        """Make the whole parameters present and registered (waits for a prefetch in flight)."""
        if not self.gathered:
            for g in self.groups:
                g.finish_gather()
            self.gathered = True
        for slot in self.slots():
            slot.register(slot.full)

    def prefetch(self) -> None:
        if not self.gathered:
            for g in self.groups:
                g.start_gather()

    def reshard(self) -> None:
        """Register the pieces again and free the whole parameters' memory."""
        for slot in self.slots():
            slot.register(slot.shard)
        if self.gathered:
            for g in self.groups:
                g.free()
            self.gathered = False

    # ------------------------------------------------------------- gradients
    def _on_full_grad(self, _: torch.Tensor) -> None:
        self.arrived += 1
        if self.arrived == self.expected:
            self.launch_reduce()

    def launch_reduce(self) -> None:
        if self.reducing is not None:
            return
        self.reducing = [(g, g.start_reduce(self.policy.reduce_dtype)) for g in self.groups]
        if self.root is not None and self is not self.root.unit:
            self.reshard()  # its backward is done: nothing needs the whole parameters now

    def finish_reduce(self) -> None:
        for g, handle in self.reducing or []:
            g.finish_reduce(handle)
        self.reducing = None
        self.arrived = 0


class Root:
    """The outermost unit's view of the whole model: order, buffers, end of backward."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.units = [u for m in unit.module.modules() if (u := getattr(m, _STATE, None))]
        for u in self.units:
            u.root = self
        for name, module in unit.module.named_modules(remove_duplicate=False):
            for pname, p in module._parameters.items():
                if isinstance(p, ShardParameter):  # names relative to the whole model now
                    p.qualified_name = f"{name}.{pname}" if name else pname
        self.order: list[Unit] = []
        self.recording = True
        self._end = EndOfBackward(self.end_of_backward)
        # DDP's rule, kept for parity with it: buffers follow rank 0 before the first forward
        # and before any forward that follows a gradient-tracked one.
        self._broadcast_next = True

    def begin_forward(self) -> None:
        if self.recording and self.order:
            self.recording = False
        broadcast, self._broadcast_next = self._broadcast_next, torch.is_grad_enabled()
        if broadcast and self.unit.broadcast_buffers:
            buffers = list(self.unit.module.buffers())
            if buffers and dist.get_world_size(self.unit.process_group) > 1:
                broadcast_coalesced(buffers, self.unit.process_group)

    def next_after(self, unit: Unit, step: int) -> Unit | None:
        if self.recording or unit not in self.order:
            return None
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def queue_end_of_backward(self) -> None:
        """Called from the first unit backward hook, which fires in the outermost backward."""
        self._end.queue()

    def end_of_backward(self) -> None:
        """Every unit's gradients reduced into the pieces; every unit freed."""
        for u in self.units:
            if u.arrived and u.reducing is None:  # a unit some of whose parameters went unused
                u.launch_reduce()
        for u in self.units:
            u.finish_reduce()
            u.reshard()


# ------------------------------------------------------------------- hooks


def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    unit: Unit = getattr(module, _STATE)
    if unit.root is None:
        Root(unit)
    root = unit.root
    assert root is not None
    if unit is root.unit:
        root.begin_forward()
    if root.recording and unit not in root.order:
        root.order.append(unit)
    unit.unshard()
    following = root.next_after(unit, +1)
    if following is not None:
        following.prefetch()
    dtype = unit.policy.param_dtype
    if dtype is not None and unit.policy.cast_forward_inputs:
        args, kwargs = map_tensors(
            lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs)
        )
    return args, kwargs


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    unit: Unit = getattr(module, _STATE)
    tracked = [t for t in iter_tensors(output) if t.requires_grad]
    if torch.is_grad_enabled() and tracked:
        register_multi_grad_hook(tracked, lambda _: _pre_backward(unit), mode="any")
    root = unit.root
    if root is not None and unit is not root.unit and unit.reshard_after_forward:
        unit.reshard()
    return output


def _pre_backward(unit: Unit) -> None:
    root = unit.root
    assert root is not None
    root.queue_end_of_backward()
    unit.unshard()
    previous = root.next_after(unit, -1)
    if previous is not None:
        previous.prefetch()


# ------------------------------------------------------------------- entry


def fully_shard(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """Shard `module`'s parameters across ranks (ZeRO-3); apply to each block, then the root.

    Returns the same module. Build the optimizer afterwards, over
    `model.parameters()`: they are this rank's pieces.
    """
    if getattr(module, _STATE, None) is not None:
        raise ConfigurationError(
            f"{type(module).__name__} is already a fully_shard unit — call fully_shard once "
            "per module (each block, then the root)"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "torch.distributed is not initialised — call phalanx.init() before fully_shard"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    managed = _unmanaged_parameters(module)
    _refuse_parameters_of_other_units(module, managed)
    if managed:
        verify_same_state([(m.fqn, m.param) for m in managed], [], group)
        broadcast_coalesced([m.param for m in managed], group)
    policy = mp_policy or MixedPrecisionPolicy()
    groups = build_groups(managed, group, policy)
    for g in groups:
        for slot in g.slots:
            slot.register(slot.shard)
        g.free()
    unit = Unit(module, groups, group, policy, reshard_after_forward, broadcast_buffers)
    for m in managed:
        _CUT_BY[id(m.param)] = (weakref.ref(m.param), f"{type(module).__name__} (at '{m.fqn}')")
    setattr(module, _STATE, unit)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    return module


def _unmanaged_parameters(module: nn.Module) -> list[Managed]:
    """Parameters of `module` not already cut by a unit below it; a tied one once, with
    every place it is registered."""
    first: dict[int, tuple[nn.Parameter, str]] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub._parameters.items()):
            if p is None or isinstance(p, ShardParameter):
                continue
            first.setdefault(id(p), (p, f"{name}.{pname}" if name else pname))
            places = owners.setdefault(id(p), [])
            if (sub, pname) not in places:
                places.append((sub, pname))
    return [Managed(p, fqn, tuple(owners[key])) for key, (p, fqn) in first.items()]


def _refuse_parameters_of_other_units(module: nn.Module, managed: list[Managed]) -> None:
    """A parameter another unit already cut, still registered whole here: tied across units."""
    for key, (ref, _) in list(_CUT_BY.items()):
        if ref() is None:
            del _CUT_BY[key]  # prune: that parameter is gone
    for m in managed:
        entry = _CUT_BY.get(id(m.param))
        other = entry[1] if entry is not None and entry[0]() is m.param else None
        if other is not None:
            raise ConfigurationError(
                f"parameter '{m.fqn}' of {type(module).__name__} is also a parameter of the "
                f"fully_shard unit {other} (tied weights) — a tied parameter must live in one "
                "unit: fully_shard only a module that contains every user of it (e.g. the root)"
            )


def unit_of(module: nn.Module) -> Unit | None:
    return getattr(module, _STATE, None)
