"""A model built on the meta device given real values, one module at a time.

Built under `torch.device("meta")` (or accelerate's `init_empty_weights()`), a
model has shapes and no storage; sharded by `fully_shard`, each rank's
parameters are meta shards. `materialize` gives them values without the whole
model ever existing on one rank: it walks the modules in registration order,
and for each module that holds meta tensors makes full-size temporaries of
its own parameters and buffers only, runs the initialiser on it, and keeps
this rank's rows of each (a shard) or the whole tensor (an unsharded one).

Why full-size temporaries rather than initialising the shards directly (as
`to_empty()` + `reset_parameters()` on DTensors does): a random initialiser
drawn on a shard draws the shard's numbers, not its rows of the whole
tensor's. On a device without DTensor's offset RNG (the CPU) every rank then
draws the same numbers, and the shards of one weight repeat each other.
Drawn whole, in registration order, from rank 0's generator, the values are
those of the same model built unsharded after `torch.manual_seed` on rank 0:
bit for bit for modules initialised by their `reset_parameters()` in
`__init__` (torch's layers). Peak memory is the largest module's own tensors.

An initialiser that leaves a tensor unset is an error naming it, never
garbage: temporaries start as NaN (integers: their minimum) and are checked.

Only what is still meta gets values. An initialiser works on a whole module
(`reset_parameters()` sets a Linear's weight and bias), so a module whose bias
was left on the meta device while its weight was loaded would have had its
loaded weight drawn again, silently. Every tensor of such a module gets a
temporary (a loaded one: a copy of its values, for an initialiser that reads
it); only the meta ones keep what the initialiser drew, and the loaded ones
are left as they were, with one logged line naming what was initialised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.zero3.module import FSDPModule
from phalanx.zero3.params import ShardedParam
from phalanx.zero3.wrap import units

Initializer = Callable[[nn.Module], None]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Materialized:
    """What `materialize` did: how many tensors it set, and its largest temporary."""

    tensors: int
    modules: int
    largest_temporary_bytes: int
    """The most bytes of full-size temporaries alive at once (one module's own tensors)."""


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter (or its shard) or buffer of `model` is on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    return any(getattr(t, "_local_tensor", t).is_meta for t in tensors)


def default_initializer(model: nn.Module) -> Initializer:
    """A transformers model's own `_init_weights(module)`, else each module's
    `reset_parameters()` (torch's layers; torchtitan's convention)."""
    hf_init = getattr(model, "_init_weights", None)

    def initialize(module: nn.Module) -> None:
        if callable(hf_init):
            hf_init(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    return initialize


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str | None = None,
    init: Initializer | None = None,
    group: dist.ProcessGroup | None = None,
) -> Materialized:
    """Give `model`'s meta parameters, shards and buffers real values (see the module doc).

    device: where unsharded tensors go (sharded ones go to their unit's home);
        default: the CPU. init: called once per module that holds meta tensors,
        with full-size temporaries registered in their place (default:
        `default_initializer(model)`). group: the ranks whose generators must
        agree (default: every rank); they draw from rank 0's. Tensors that were
        not meta keep their values. A tensor registered in several modules (tied
        weights) keeps the values of its first owner in registration order; the
        later owners' initialisers still run, drawing what an unsharded build draws.
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    initialize = init or default_initializer(model)
    meta = _meta_places(model)
    if not meta:
        return Materialized(0, 0, 0)
    _use_rank0_generator(group)
    _allocate(model, target)
    sharded = {id(sp.sharded): sp for unit in units(model) for sp in unit.params}
    done: set[int] = set()
    largest = count = modules = 0
    beside_loaded: list[str] = []
    for qualified, module in model.named_modules():
        names = meta.get(id(module))
        if not names:
            continue
        # Every own tensor gets a temporary: the initialiser must not reach a loaded one.
        temporaries = _swap_in_temporaries(module, _own_names(module), set(names))
        largest = max(largest, sum(t.nbytes for t, _ in temporaries.values()))
        try:
            initialize(module)
        finally:
            values = {n: _take_back(module, n, final) for n, (_, final) in temporaries.items()}
        for name in names:
            count += _keep(module, name, values[name], temporaries[name][1], sharded, done)
        if len(names) < len(temporaries):
            beside_loaded += [f"{qualified}.{n}" if qualified else n for n in names]
        modules += 1
    _say_initialised_beside_loaded(beside_loaded)
    return Materialized(count, modules, largest)


def _say_initialised_beside_loaded(names: list[str]) -> None:
    """One line for the tensors left on meta in modules whose other tensors were loaded: a
    checkpoint that lacked them, most likely, which the user may want to know."""
    if names:
        logger.warning(
            "materialize: %s still on the meta device beside loaded tensors of the same "
            "module: initialised; the loaded tensors keep their values",
            ", ".join(names),
        )


def _own_names(module: nn.Module) -> list[str]:
    """The names of the module's own parameters and buffers (not its children's)."""
    own = [*module._parameters.items(), *module._buffers.items()]
    return [name for name, t in own if t is not None]


def _allocate(model: nn.Module, unsharded: torch.device) -> None:
    """Storage for every meta tensor (not yet its values): shards at their unit's home (a
    file under disk offload), the rest on `unsharded`; a tied tensor stays one tensor."""
    shards = {id(sp.sharded): sp for unit in units(model) for sp in unit.params}
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is None or not getattr(t, "_local_tensor", t).is_meta:
                    continue
                if id(t) not in made:
                    made[id(t)] = _empty_like(t, shards.get(id(t)), unsharded)
                slots[name] = made[id(t)]  # type: ignore[assignment]
    for unit in units(model):  # each shard goes home, registered wherever its parameter is
        unit.mark_stale()
        unit.refresh()


def _empty_like(
    t: torch.Tensor, shard: ShardedParam | None, unsharded: torch.device
) -> torch.Tensor:
    if shard is None:
        empty = torch.empty(t.shape, dtype=t.dtype, device=unsharded)
        return nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    from torch.distributed.tensor import DTensor

    local = torch.empty(shard.local_shape, dtype=t.dtype, device=shard.info.device)
    spread = DTensor.from_local(
        local,
        shard.info.mesh,
        shard.info.placements,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )
    return nn.Parameter(spread, requires_grad=t.requires_grad)


def _meta_places(model: nn.Module) -> dict[int, list[str]]:
    """For each module (by id), the names of its own parameters and buffers that are meta."""
    places: dict[int, list[str]] = {}
    for module in model.modules():
        own = [*module._parameters.items(), *module._buffers.items()]
        names = [n for n, t in own if t is not None and getattr(t, "_local_tensor", t).is_meta]
        if names:
            places[id(module)] = names
    return places


def _use_rank0_generator(group: dist.ProcessGroup | None) -> None:
    """Every rank draws what rank 0 would: its CPU generator's state, broadcast."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    ranks = group if group is not None else dist.group.WORLD
    assert ranks is not None
    state = torch.get_rng_state()  # a byte tensor of fixed size: no object collective
    dist.broadcast(state, src=dist.get_global_rank(ranks, 0), group=group)
    torch.set_rng_state(state)


Swapped = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _swap_in_temporaries(module: nn.Module, names: list[str], meta: set[str]) -> Swapped:
    """Full-size CPU temporaries registered in place of `names`; for each name, (temporary,
    the tensor to restore). Those in `meta` start with a value no initialiser leaves; the
    others (loaded) with their own values where those are whole here, else the same."""
    swapped: Swapped = {}
    for name in names:
        is_param = name in module._parameters
        final = module._parameters[name] if is_param else module._buffers[name]
        assert final is not None
        temporary = torch.empty(final.shape, dtype=final.dtype)
        if name in meta or hasattr(final, "_local_tensor"):  # a shard: not whole here
            _fill_unset(temporary)
        else:
            temporary.copy_(final.detach())
        if is_param:
            module._parameters[name] = nn.Parameter(temporary, requires_grad=final.requires_grad)
        else:
            module._buffers[name] = temporary
        swapped[name] = (temporary, final)
    return swapped


def _take_back(module: nn.Module, name: str, final: torch.Tensor) -> torch.Tensor:
    """Register `final` again under `name`; the value the initialiser left there (in the
    temporary, or in a tensor it assigned in its place)."""
    slots = module._parameters if name in module._parameters else module._buffers
    value = slots[name]
    slots[name] = final  # type: ignore[assignment]
    assert value is not None
    return value.detach()


def _keep(
    module: nn.Module,
    name: str,
    value: torch.Tensor,
    final: torch.Tensor,
    sharded: dict[int, ShardedParam],
    done: set[int],
) -> int:
    """Copy the initialised `value` (this rank's rows of it, for a sharded parameter) into
    `final`; 1 if it was set, 0 if a tied tensor's later owner left it as its first set it."""
    if id(final) in done:
        return 0  # tied: it keeps the value its first owner gave it (see `materialize`)
    unset = _unset_mask(value)
    if bool(unset.any()):
        kind = "parameter" if name in module._parameters else "buffer"
        cls = _class_name(module)
        raise ConfigurationError(
            f"{kind} '{name}' of {cls} was built on the meta device and no initialiser set "
            f"it ({cls} has no reset_parameters() that does) — give {cls} a "
            "reset_parameters() that sets it, pass init=, or build the model on a real device"
        )
    sp = sharded.get(id(final))
    if sp is not None:
        start, stop = sp.rows
        sp.local.copy_(value.reshape(sp.shape)[start:stop])
        sp.home.settle([sp.local])  # in a file: its pages leave this process, written
    else:
        final.copy_(value)
    done.add(id(final))
    return 1


def _class_name(module: nn.Module) -> str:
    """The user's class, not the `FSDP<Class>` fully_shard made of it."""
    cls = type(module)
    return cls.__mro__[2].__name__ if isinstance(module, FSDPModule) else cls.__name__


def _fill_unset(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)
    else:
        t.fill_(False)


def _unset_mask(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return torch.isnan(t)
    if t.dtype == torch.bool:
        return torch.zeros_like(t)
    return t == torch.iinfo(t.dtype).min
