"""The hooks a unit runs around its module's forward and backward.

Before a unit's forward its parameters are gathered (and the next unit's
gather is issued: the order is recorded in the first forward, or set with
`set_modules_to_forward_prefetch`); after it they are freed as
`reshard_after_forward` says, and a hook on the outputs gathers them again
when the backward reaches the unit (prefetching the unit that ran before it).
A forward that runs during the unit's backward is activation checkpointing
recomputing it: the parameters are only gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from phalanx.runtime.nested import iter_tensors, map_tensors
from phalanx.zero3.root import Root, unit_of
from phalanx.zero3.unit import Unit, UnitPhase


def pre_forward(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    unit = unit_of(module)
    assert unit is not None
    if unit.phase is UnitPhase.BACKWARD:  # activation checkpointing recomputes this forward
        if unit.unshard_in_backward:
            unit.unshard()
        return _cast_inputs(unit, args, kwargs)
    if not unit.to_run:  # a pass through the unit's modules begins (FSDP2's group hooks)
        unit.to_run.update(unit.modules)
    if unit.phase is UnitPhase.FORWARD:  # a group's next module, in the same pass
        unit.unshard()
        return _cast_inputs(unit, args, kwargs)
    root = unit.root if unit.root is not None else Root(unit)
    if unit is root.unit:
        root.begin_forward(args, kwargs)
    root.record(unit)
    unit.phase = UnitPhase.FORWARD
    unit.unshard()
    targets = unit.forward_prefetch
    for target in targets if targets is not None else [root.next_after(unit, +1)]:
        if target is not None:
            target.prefetch()
    return _cast_inputs(unit, args, kwargs)


def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    """The unit's forward ends with its last module's (a group's others only cast their
    outputs); the root's ends the forward of every group it left incomplete as well."""
    unit = unit_of(module)
    assert unit is not None
    if unit.phase is UnitPhase.BACKWARD or module not in unit.to_run:
        return _cast_output(unit, output)
    unit.to_run.discard(module)
    if unit.to_run:
        return _cast_output(unit, output)
    _end_forward(unit, output)
    root = unit.root
    if root is not None and unit is root.unit:
        output = _complete_groups(root, output)
        root.end_forward()
    return _cast_output(unit, output)


def _end_forward(unit: Unit, output: Any) -> None:
    """Free as reshard_after_forward says; the backward through `output` gathers again."""
    tracked = [t for t in iter_tensors(output) if t.requires_grad]
    if torch.is_grad_enabled() and tracked:
        register_multi_grad_hook(tracked, lambda _: pre_backward(unit), mode="any")
    unit.after_forward()
    unit.phase = UnitPhase.IDLE


def _complete_groups(root: Root, output: Any) -> Any:
    """FSDP2's `_force_complete_incomplete_states`: a group whose forward ran only some of
    its modules (chunked loss: the root runs the norm, the head is called per chunk after)
    ends its forward with the root's, its backward hooked on the root's output; innermost
    first, each casting the output to its output_dtype, as the unwinding would have."""
    for unit in reversed(root.units):
        if unit is root.unit or not unit.to_run:
            continue
        _end_forward(unit, output)
        output = _cast_output(unit, output)
        unit.to_run.clear()
    return output


def pre_backward(unit: Unit) -> None:
    root = unit.root
    assert root is not None
    root.queue_end_of_backward()
    unit.phase = UnitPhase.BACKWARD
    if unit.unshard_in_backward:  # (FSDP2's set_unshard_in_backward: e.g. an embedding)
        unit.unshard()
    targets = unit.backward_prefetch
    for target in targets if targets is not None else [root.next_after(unit, -1)]:
        if target is not None and target.unshard_in_backward:
            target.prefetch()


def _cast_inputs(unit: Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
    dtype = unit.policy.param_dtype
    if dtype is None or not unit.policy.cast_forward_inputs:
        return args, kwargs
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))


def _cast_output(unit: Unit, output: Any) -> Any:
    dtype = unit.policy.output_dtype
    if dtype is None:
        return output
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
