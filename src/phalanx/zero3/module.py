"""`FSDPModule`: what a module becomes when fully_shard is applied to it (FSDP2's class swap).

`fully_shard(m)` changes `m`'s class to `FSDP<Class>`, a subclass of both
`FSDPModule` and `m`'s own class, so `isinstance(m, FSDPModule)` holds and
everything of the original class still works. The methods are FSDP2's, with
its names and meanings; the few phalanx does not implement raise
`NotSupportedError` naming themselves, never pass silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigurationError, NotSupportedError
from phalanx.zero3.hooks import post_forward, pre_forward
from phalanx.zero3.params import ShardUseError
from phalanx.zero3.root import unit_of
from phalanx.zero3.unit import Unit

# One FSDP<Class> per user class, as torch's fully_shard keeps: every unit of a class is
# then of one type (isinstance, pickling by name, torch.compile's guards). It is kept in
# the user class's own __dict__, so a subclass does not inherit its parent's.
_SHARDED_CLASS = "_phalanx_fsdp_class"
_DTENSOR_MIX = "mixed torch.Tensor and DTensor"


class UnshardHandle:
    """An `unshard(async_op=True)` in flight: `wait()` makes the parameters present."""

    def __init__(self, unit: Unit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.unshard()
            self._unit = None


class FSDPModule:
    """A fully_shard module. Its parameters are DTensors sharded on dim 0 between steps."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing this class (a container indexed by a slice does) builds the original."""
        original: Any = cls.__mro__[2]
        self = original.__new__(original)
        self.__init__(*args, **kwargs)
        return self

    # ------------------------------------------------------------ the unit
    def _unit(self) -> Unit:
        unit = unit_of(cast(nn.Module, self))
        assert unit is not None
        return unit

    def _units(self, recurse: bool) -> Iterable[Unit]:
        """This module's unit (shared by a group's modules), or every unit in it, once each."""
        if not recurse:
            return [self._unit()]
        found: dict[int, Unit] = {}
        for m in cast(nn.Module, self).modules():
            if (u := unit_of(m)) is not None:
                found.setdefault(id(u), u)
        return list(found.values())

    # ------------------------------------------------------- gather / free
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters (not its sub-units'); with `async_op`, return a
        handle whose `wait()` makes them present (the next forward waits by itself)."""
        unit = self._unit()
        if async_op:
            unit.prefetch()
            return UnshardHandle(unit)
        unit.unshard()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones."""
        self._unit().reshard()

    # --------------------------------------------------------------- knobs
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward accumulates unsharded gradients without communicating (gradient
        accumulation); the next backward with True reduces the sum."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync
            unit.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters within the shard group but keeps the result for a
        later all-reduce across replicas."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ConfigurationError(
                f"set_reshard_after_forward takes a bool, not {reshard_after_forward!r}"
            )
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False keeps the unsharded parameters after backward (gradient accumulation
        without the next forward's gather); set it back before the optimizer step."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: every backward here waits for its reductions at its end, which is what
        FSDP2 does on the last one."""

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._unit().forward_prefetch = [_unit_arg(m, "forward") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._unit().backward_prefetch = [_unit_arg(m, "backward") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the number of ranks."""
        for unit in self._units(recurse=False):
            unit.divisor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted: gathers are issued on the stream the optimizer stepped on, after it."""

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for what is in flight, reshard all."""
        root = self._unit().root
        if root is None or root.unit is not self._unit():
            raise ConfigurationError("reset_iter_state() is called on the root module")
        root.reset()

    def set_custom_all_gather(self, comm: Any) -> NoReturn:
        _unsupported("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> NoReturn:
        _unsupported("set_custom_reduce_scatter")

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """`hook(reduced)` on this unit's reduced gradient rows, in place, before they become
        the sharded gradients: after the reduce-scatter, or HSDP's all-reduce (a custom
        replication of your own on a 1-D mesh goes here). phalanx runs it on the current
        stream; `stream` is refused under HSDP, as FSDP2 refuses it."""
        unit = self._unit()
        if stream is not None and unit.info.replicate_group is not None:
            raise ConfigurationError(
                "set_all_reduce_hook(stream=...) under HSDP — drop stream: the hook runs "
                "after HSDP's own all-reduce"
            )
        unit.all_reduce_hook = hook
        unit.configure_groups()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: the collectives only sum, and the sum is divided afterwards (by the
        divide factor), FSDP2's order (NCCL's zero-copy paths take sums only). This
        module's unit, not the ones below (as FSDP2)."""
        for unit in self._units(recurse=False):
            unit.force_sum = bool(enable)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: a parameter that got no gradient this backward gets the reduced one anyway
        (zeros where no rank used it), as FSDP2 with this on; off, its .grad stays None. A
        unit's reduce-scatter always spans all its parameters here, so ranks that used
        different parameters still pair up either way."""
        for unit in self._units(recurse):
            unit.reduce_unused = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many units' reduce-scatters may be in flight (1: each launch finishes the one
        before); more overlaps an exposed reduction with backward, for more memory. The
        root keeps the largest any unit asks for, as FSDP2 does."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise ConfigurationError(
                f"set_reduce_scatter_max_input_buffers takes an int, not {max_input_buffers!r}"
            )
        if max_input_buffers < 1:
            raise ConfigurationError(
                f"set_reduce_scatter_max_input_buffers({max_input_buffers}) — pass 1 or more"
            )
        for unit in self._units(recurse):
            unit.reduce_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """True: reduce-scatters run in a process group of their own over the same ranks, so
        they progress beside the gathers; False: back in the shard group. Collective: every
        rank of the mesh calls it (it creates the group, one per set of shard ranks)."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for unit in self._units(recurse):
            if not enable:
                unit.reduce_group = None
                unit.configure_groups()
                continue
            ranks = tuple(dist.get_process_group_ranks(unit.info.shard_group))
            if ranks not in made:
                made[ranks] = unit.reduce_group or dist.new_group(
                    list(ranks), use_local_synchronization=True
                )
            unit.reduce_group = made[ranks]
            unit.configure_groups()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's parameters are not gathered for its backward (nor prefetched
        then), for a module whose backward needs none of their values (an embedding: its
        gradient comes from the indices); its gradients are reduced as ever."""
        self._unit().unshard_in_backward = bool(unshard_in_backward)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> NoReturn:
        _unsupported("set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> NoReturn:
        _unsupported("set_symm_mem_for_comm")

    # ------------------------------------------------------- nn.Module parts
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except RuntimeError as exc:
            if _DTENSOR_MIX not in str(exc) or isinstance(exc, ShardUseError):
                raise
            raise _misuse(self._unit()) from exc

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """`.to()`, `to_empty()`, ...: applied to the sharded parameters, which are followed."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        self._unit().mark_stale()
        self._unit().refresh()
        return result

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise ConfigurationError(
            "a fully_shard module cannot be deep-copied (its parameters are shards) — copy the "
            "model before fully_shard, or save and load its state dict"
        )


def _unit_arg(module: Any, direction: str) -> Unit:
    unit = unit_of(module) if isinstance(module, nn.Module) else None
    if unit is None:
        raise ConfigurationError(
            f"set_modules_to_{direction}_prefetch takes fully_shard modules; "
            f"{type(module).__name__} is not one"
        )
    return unit


def _unsupported(method: str) -> NoReturn:
    raise NotSupportedError(
        f"FSDPModule.{method} is not supported by phalanx's fully_shard — drop the call "
        "(phalanx runs its own gathers and reductions, see docs/zero.md)"
    )


def _misuse(unit: Unit) -> ShardUseError:
    root = unit.root
    units = root.units if root is not None else [unit]
    sharded = [u for u in units if not u.is_unsharded and u.params]
    where = "; ".join(
        f"unit '{u.name or type(u.module).__name__}' ({u.parameter_names()})" for u in sharded[:3]
    )
    return ShardUseError(
        f"a parameter of a fully_shard unit was used outside that unit's forward, where it "
        f"is this rank's shard (a DTensor) — sharded at that moment: {where or 'none'}; use a "
        "unit's parameters only inside its forward, or fully_shard a module that contains "
        "every module using them (tied weights belong in one unit)"
    )


def swap_class(module: nn.Module) -> None:
    """Make `module` an `FSDP<Class>`: FSDPModule first in the MRO, its own class next."""
    cls = type(module)
    swapped = cls.__dict__.get(_SHARDED_CLASS)
    if swapped is None:
        swapped = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        setattr(cls, _SHARDED_CLASS, swapped)
    module.__class__ = swapped


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's gather and free around `module.<method_name>` too (e.g. `generate`),
    as around forward. A module that is not a fully_shard unit is left as it is."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ConfigurationError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        return post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
