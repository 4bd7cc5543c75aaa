"""ZeRO stage 3: parameters, gradients and optimizer state sharded (FSDP2-style `fully_shard`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.optim.zero_state import clip_pieces
from phalanx.zero3.params import ShardParameter, ShardUseError, full_shape_of
from phalanx.zero3.policy import Policy, by_class_names, repeated_blocks, shard_model
from phalanx.zero3.state import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    load_model_sharded,
    load_optimizer_sharded,
    save_model_sharded,
    save_optimizer_sharded,
    sharded_state_dict,
)
from phalanx.zero3.unit import MixedPrecisionPolicy
from phalanx.zero3.wrap import fully_shard, unit_of

__all__ = [
    "MixedPrecisionPolicy",
    "Policy",
    "ShardParameter",
    "ShardUseError",
    "by_class_names",
    "clip_grad_norm_",
    "communication_stats",
    "full_optimizer_state_dict",
    "full_shape_of",
    "full_state_dict",
    "fully_shard",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_model_sharded",
    "load_optimizer_sharded",
    "repeated_blocks",
    "save_model_sharded",
    "save_optimizer_sharded",
    "shard_model",
    "shard_parameters",
    "sharded_state_dict",
    "unit_of",
]


def communication_stats(model: nn.Module) -> dict[str, float]:
    """Summed over the model's units: gathers and reduces, and how long training waited."""
    total = {"gathers": 0.0, "gather_wait_s": 0.0, "reduces": 0.0, "reduce_wait_s": 0.0}
    for module in model.modules():
        unit = unit_of(module)
        for group in unit.groups if unit is not None else []:
            for key in total:
                total[key] += getattr(group.stats, key)
    return total


def shard_parameters(model: nn.Module) -> Iterator[ShardParameter]:
    """The pieces this rank keeps, each once (what the optimizer steps)."""
    seen: set[int] = set()
    for p in model.parameters():
        if isinstance(p, ShardParameter) and id(p) not in seen:
            seen.add(id(p))
            yield p


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a fully_shard model: the global norm from the pieces."""
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    return clip_pieces(list(shard_parameters(model)), max_norm, norm_type, group)
