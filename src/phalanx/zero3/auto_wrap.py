"""Which modules become fully_shard units when the caller does not say: the repeated blocks.

A transformer (or any deep stack) keeps most of its parameters in a list of
blocks of one class; sharding each block as a unit bounds the memory of the
whole parameters alive at once to one block's, and the root takes the rest
(embeddings, the head, final norms). `shard_model` applies a policy, then the
root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.zero3.policies import DiskOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from phalanx.zero3.wrap import fully_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Policy = Callable[[nn.Module], Iterable[nn.Module]]


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of the heaviest ModuleList (or Sequential) whose members that hold
    parameters share one class (a Sequential's activations and dropouts hold none)."""
    best: list[nn.Module] = []
    best_weight = 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        members = [m for m in module if _params(m)]
        if len(members) < 2 or len({type(m) for m in members}) != 1:
            continue
        weight = sum(_params(m) for m in members)
        if weight > best_weight:
            best, best_weight = members, weight
    return best


def by_class_names(names: Sequence[str]) -> Policy:
    """Every module whose class name is in `names` (outermost first; none inside another)."""
    wanted = set(names)

    def policy(model: nn.Module) -> list[nn.Module]:
        found: list[nn.Module] = []
        for module in model.modules():
            inside = any(_contains(outer, module) for outer in found)
            if type(module).__name__ in wanted and module is not model and not inside:
                found.append(module)
        if not found:
            raise ConfigurationError(
                f"no module of class {sorted(wanted)} in {type(model).__name__} — name the "
                "class of its repeated blocks (e.g. 'Block', 'GPT2Block', 'LlamaDecoderLayer')"
            )
        return found

    return policy


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def shard_model(
    model: nn.Module,
    policy: Policy | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """fully_shard each unit the policy picks (default: the repeated blocks), then the root,
    over `mesh` (default: every rank); `reshard_after_forward` is the units' (the root keeps
    its parameters after forward, as FSDP2's does). A fractional disk offload chooses its
    shards in files over the whole model first."""
    if isinstance(offload_policy, DiskOffloadPolicy):
        offload_policy.plan(p for p in model.parameters() if not hasattr(p, "_local_tensor"))
    for unit in (policy or repeated_blocks)(model):
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
