"""`fully_shard(module)`: ZeRO stage 3 with FSDP2's interface, on phalanx's own runtime.

Apply it to each block, then to the root. Each call makes `module` (or a
list of modules, FSDP2's group) a unit: its parameters (those not already in
a unit below it, nor ignored) become DTensors sharded on dim 0 over the mesh,
registered in place of the originals, and the module becomes an
`FSDPModule`. Build the optimizer afterwards, over `model.parameters()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import ConfigurationError, NotSupportedError, OffloadError
from phalanx.offload.files import OffloadFiles
from phalanx.parallel.sync import broadcast_coalesced, verify_same_state
from phalanx.runtime.agree import raise_on_every_rank
from phalanx.runtime.exit import register_exit_hook
from phalanx.zero3.home import FileHome, Home, homes_of
from phalanx.zero3.hooks import post_forward, pre_forward
from phalanx.zero3.mesh import (
    MeshInfo,
    check_reshard_size,
    mesh_info,
    post_forward_group,
    unit_group,
)
from phalanx.zero3.module import FSDPModule, swap_class
from phalanx.zero3.params import Owners, ShardedParam
from phalanx.zero3.policies import MixedPrecisionLike, mixed_precision, offload

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
    from torch.distributed.tensor import Placement

    from phalanx.offload.policies import OffloadPolicy
from phalanx.zero3.root import STATE, unit_of
from phalanx.zero3.unit import Unit, UnitPhase

_TAKEN_BY = "_phalanx_taken_by"
"""The attribute a unit writes on each original parameter it took (naming the unit): one
still registered whole somewhere else (tied weights) must not be taken again by another
unit. The fact belongs to the parameter, so it lives and dies with it."""


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[nn.Module]: ...
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionLike | None = None,
    offload_policy: OffloadPolicy | TorchOffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: object | None = None,
    broadcast_buffers: bool = True,
    **unsupported: object,
) -> nn.Module | list[nn.Module]:
    """Shard `module`'s parameters across the mesh (ZeRO-3, FSDP2's arguments).

    module: a module, or a list of modules as one unit (FSDP2's group, e.g. `[model.norm,
        model.head]`: one gather and one reduce-scatter; docs/fsdp2.md).
    mesh: 1-D (FSDP) or 2-D `(replicate, shard)` (HSDP); default: every rank.
    reshard_after_forward: free the parameters after forward (True), keep them (False),
        or keep 1/k of them to gather back within groups of k ranks (an int k); None:
        False for the root, True for the others.
    shard_placement_fn: may return None or Shard(0) (dim 0 is what phalanx shards).
    mp_policy: MixedPrecisionPolicy (ours or torch's). offload_policy: OffloadPolicy(),
        CPUOffloadPolicy() (shards in host memory) or DiskOffloadPolicy(path) (in files).
        ignored_params: left whole, never reduced.
    dp_mesh_dims: None (a DataParallelMeshDims, tensor parallel's, is refused).
    broadcast_buffers: (phalanx's) rank 0's buffers before a forward, DDP's rule.
    Returns `module` (each of them), now an instance of `phalanx.FSDPModule`.
    """
    modules = _modules_of(module)
    for m in modules:
        _refuse(m, unsupported, dp_mesh_dims)
    info = mesh_info(mesh)
    policy = mixed_precision(mp_policy)
    reshard = check_reshard_size(reshard_after_forward, info)
    managed, what = _managed_parameters(modules, set(ignored_params or ())), _described(modules)
    homes = homes_of(offload(offload_policy, info.device), info.device, [m[0] for m in managed])
    _check_placements(managed, shard_placement_fn)
    _refuse_parameters_of_other_units(what, managed)
    _move_to_device(modules, managed, info)
    _sync_initial_values(managed, info, _settings(what, info, reshard, policy, ignored_params))
    params = _shard_parameters(managed, info, homes)
    group = post_forward_group(info, reshard) if isinstance(reshard, int) and reshard > 1 else None
    unit = Unit(modules, params, info, policy, reshard, broadcast_buffers, group)
    for p, fqn, _ in managed:
        setattr(p, _TAKEN_BY, f"{what} (at '{fqn}')")
    _install(modules, unit)
    return module


def _install(modules: Sequence[nn.Module], unit: Unit) -> None:
    """Make each module a unit of `unit`: FSDP<Class>, its hooks, the exit hook."""
    # A script written for FSDP2 never calls phalanx.init(), which installs this: without
    # it, a gloo thread freeing a finished gather at interpreter exit can abort a run that
    # succeeded ("terminate called without an active exception", seen 1 run in 10 at 3 ranks).
    register_exit_hook()
    for m in modules:
        _hook(m, unit)


def _hook(module: nn.Module, unit: Unit) -> None:
    """One module of `unit`: its hooks, and its class made `FSDP<Class>`."""
    setattr(module, STATE, unit)
    module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    module.register_forward_hook(post_forward)
    module.register_state_dict_pre_hook(lambda *_: _to_sharded(unit))
    module._register_load_state_dict_pre_hook(lambda *_: _to_sharded(unit))
    module.register_load_state_dict_post_hook(lambda *_: _adopt(unit))
    swap_class(module)


def _modules_of(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    """The unit's modules: `module`, or a list's modules less those inside another of them
    (FSDP2's `_get_root_modules`)."""
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, list | tuple) or not module:
        raise ConfigurationError(
            f"fully_shard takes a module or a non-empty list of modules, not {module!r}"
        )
    for m in module:
        if not isinstance(m, nn.Module):
            raise ConfigurationError(
                f"fully_shard([...]) takes modules; {type(m).__name__} is not one"
            )
    inner = {id(sub) for m in module for sub in m.modules() if sub is not m}
    return tuple(dict.fromkeys(m for m in module if id(m) not in inner))


def _described(modules: tuple[nn.Module, ...]) -> str:
    names = ", ".join(type(m).__name__ for m in modules)
    return names if len(modules) == 1 else f"[{names}]"


def _shard_parameters(
    managed: list[Managed], info: MeshInfo, homes: list[Home]
) -> list[ShardedParam]:
    """Each parameter's shard, at its home, registered in its place; in files, a full disk
    on any rank is raised on all of them here (runtime/agree.py), before the ranks'
    collectives drift apart."""
    failure: OffloadError | None = None
    params: list[ShardedParam] = []
    try:
        params = [
            ShardedParam(p, fqn, owners, info, home)
            for (p, fqn, owners), home in zip(managed, homes)
        ]
    except OffloadError as e:
        failure = e
    if any(home.in_files for home in homes):
        raise_on_every_rank(failure, unit_group(info))
    elif failure is not None:
        raise failure
    for sp in params:
        sp.register(sp.sharded)
    return params


def _to_sharded(unit: Unit) -> None:
    if unit.phase is not UnitPhase.FORWARD:
        unit.reshard()


def _adopt(unit: Unit) -> None:
    unit.mark_stale()
    unit.refresh()


def _refuse(module: nn.Module, unsupported: dict[str, Any], dp_mesh_dims: Any) -> None:
    if unsupported:
        name = sorted(unsupported)[0]
        raise NotSupportedError(
            f"fully_shard({name}=...) is not supported by phalanx — drop it (supported: mesh, "
            "reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, "
            "ignored_params, dp_mesh_dims=None, broadcast_buffers)"
        )
    if dp_mesh_dims is not None:
        raise NotSupportedError(
            "fully_shard(dp_mesh_dims=...) shards DTensor parameters of a full SPMD mesh "
            "(tensor parallel beside data parallel), which phalanx does not do — pass the "
            "data-parallel mesh itself (1-D, or 2-D (replicate, shard)) without dp_mesh_dims, "
            "or use torch.distributed.fsdp.fully_shard"
        )
    if isinstance(module, FSDPModule) or unit_of(module) is not None:
        raise ConfigurationError(
            f"{type(module).__name__} is already a fully_shard unit — call fully_shard once "
            "per module (each block, then the root)"
        )
    if type(module).__name__.startswith("FSDP") and hasattr(module, "_get_fsdp_state"):
        raise ConfigurationError(
            f"{type(module).__name__} was sharded by torch's fully_shard — use one of the two"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "torch.distributed is not initialised — call phalanx.init() before fully_shard"
        )


Managed = tuple[nn.Parameter, str, Owners]


def _managed_parameters(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
) -> list[Managed]:
    """Parameters of `modules` not already in a unit below them nor ignored; a tied one
    once, with every place it is registered. A unit's parameter is known by the object
    the unit holds (a `.to()` swaps a DTensor parameter's contents, not its identity)."""
    skip = {id(p) for p in ignored} | {id(p) for m in modules for p in unit_faces(m)}
    first: dict[int, tuple[nn.Parameter, str]] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for i, module in enumerate(modules):
        for name, sub in module.named_modules(remove_duplicate=False):
            if len(modules) > 1:
                name = f"{i}.{name}" if name else str(i)
            for pname, p in list(sub._parameters.items()):
                if p is None or id(p) in skip:
                    continue
                fqn = f"{name}.{pname}" if name else pname
                _refuse_foreign_dtensor(p, fqn)
                first.setdefault(id(p), (p, fqn))
                places = owners.setdefault(id(p), [])
                if (sub, pname) not in places:
                    places.append((sub, pname))
    return [(p, fqn, tuple(owners[key])) for key, (p, fqn) in first.items()]


def unit_faces(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter object the units in `model` hold: sharded faces, and the unsharded
    ones that exist."""
    return [
        face
        for unit in units(model)
        for sp in unit.params
        for face in (sp.sharded, sp.unsharded)
        if face is not None
    ]


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters of the fully_shard units in `model`: what an optimizer of a
    stage-3 model steps (the same objects as `model.parameters()` yields)."""
    return [sp.sharded for unit in units(model) for sp in unit.params]


def redeal(
    model: nn.Module,
    values: list[torch.Tensor],
    mesh: DeviceMesh | None = None,
    rows: bool = False,
) -> None:
    """Deal every unit of `model` again over `mesh` (default: every rank now) from the whole
    values of its parameters, in `sharded_parameters` order, or (`rows`) from this rank's
    rows of each alone (live recovery: another world size). The sharded parameters are new
    objects: build the optimizer again."""
    info = mesh_info(mesh)
    roots = list({id(u.root): u.root for u in units(model) if u.root is not None}.values())
    for root in roots:
        root.abandon()  # the iteration the loss cut short, wherever each rank was in it
    each = iter(values)
    for unit in units(model):
        unit.redeal(info, [next(each) for _ in unit.params], rows)
    for root in roots:
        root.record_again()  # every rank gathers in the same order from the next iteration


def is_sharded(param: nn.Parameter, model: nn.Module) -> bool:
    """Whether `param` is the sharded face of a parameter of a fully_shard unit in `model`."""
    return any(p is param for p in sharded_parameters(model))


def _refuse_foreign_dtensor(p: nn.Parameter, fqn: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        raise NotSupportedError(
            f"parameter '{fqn}' is already a DTensor (tensor parallel, or torch's fully_shard): "
            "phalanx's fully_shard shards plain parameters — apply it to a plain model"
        )


def _check_placements(managed: list[Managed], placement_fn: Callable[..., Any] | None) -> None:
    from torch.distributed.tensor import Shard

    if placement_fn is None:
        return
    for p, fqn, _ in managed:
        placement = placement_fn(p)
        if placement is not None and placement != Shard(0):
            raise NotSupportedError(
                f"shard_placement_fn returned {placement} for '{fqn}': phalanx shards every "
                "parameter on dim 0 — return None or Shard(0), or drop shard_placement_fn"
            )


def _refuse_parameters_of_other_units(what: str, managed: list[Managed]) -> None:
    """A parameter another unit already took, still registered whole here: tied across units."""
    for p, fqn, _ in managed:
        other = getattr(p, _TAKEN_BY, None)
        if other is not None:
            raise ConfigurationError(
                f"parameter '{fqn}' of {what} is also a parameter of the "
                f"fully_shard unit {other} (tied weights) — a tied parameter must live in one "
                "unit: fully_shard its users together (fully_shard([a, b])) or only a module "
                "that contains every user of it (e.g. the root)"
            )


def _move_to_device(modules: tuple[nn.Module, ...], managed: list[Managed], info: MeshInfo) -> None:
    """FSDP2 moves a unit's parameters and buffers to the mesh's device (not from meta)."""
    for p, _, _ in managed:
        if not p.is_meta and p.device != info.device:
            with torch.no_grad():
                p.data = p.data.to(info.device)
    for buffers_owner in (sub for m in modules for sub in m.modules()):
        for name, b in buffers_owner._buffers.items():
            if b is not None and not b.is_meta and b.device != info.device:
                buffers_owner._buffers[name] = b.to(info.device)


def _settings(
    what: str, info: MeshInfo, reshard: Any, policy: Any, ignored: Any
) -> dict[str, object]:
    """What shapes this unit's collectives: every rank must agree (checked at wrap)."""
    return {
        "wrapper": f"phalanx.fully_shard({what})",
        "mesh": tuple(info.mesh.shape),
        "reshard_after_forward": reshard,
        "mp_policy": str(policy),
        "ignored_params": len(ignored or ()),
    }


def _sync_initial_values(
    managed: list[Managed], info: MeshInfo, settings: dict[str, object]
) -> None:
    """The same parameters on every rank (names, shapes, dtypes; else one clear error), then
    rank 0's values, as DDP starts: replicas agree whatever each rank's seed was. Meta
    parameters (initialised after fully_shard) are only checked."""
    group = unit_group(info)
    verify_same_state([(fqn, p) for p, fqn, _ in managed], [], group, settings)
    values = [p for p, _, _ in managed if not p.is_meta]
    if values and dist.get_world_size(group) > 1:
        broadcast_coalesced(values, group)


def params_in_files(model: nn.Module) -> list[ShardedParam]:
    """`model`'s sharded parameters whose shards (and gradients) live in files."""
    return [
        p for unit in units(model) for group in unit.groups for p in group.params if p.home.in_files
    ]


def shard_files(model: nn.Module) -> list[OffloadFiles]:
    """The scratch directories `model`'s shards live in (DiskOffloadPolicy's), each once."""
    found: list[OffloadFiles] = []
    for p in params_in_files(model):
        assert isinstance(p.home, FileHome)
        if all(p.home.files is not f for f in found):
            found.append(p.home.files)
    return found


def units(model: nn.Module) -> list[Unit]:
    """The units in `model`, each once (a group's modules share one)."""
    found: dict[int, Unit] = {}
    for m in model.modules():
        u = unit_of(m)
        if u is not None:
            found.setdefault(id(u), u)
    return list(found.values())
