"""ZeRO stage 3 as FSDP2 has it: `fully_shard`, DTensor parameters, `FSDPModule`.

Parameters, gradients and optimizer state are sharded on dim 0 across the
mesh; the gathers, reduce-scatters, prefetching and reshard policy are
phalanx's own (zero3/unit.py, zero3/group.py); the parameters are torch's
DTensors, so torch's own tools (clip_grad_norm_, the DCP state-dict
functions, optimizers, meta-device initialisation) work on them unchanged.
"""

from __future__ import annotations

from torch import nn

from phalanx.parallel.traffic import NO_TRAFFIC, Traffic
from phalanx.zero3.auto_wrap import Policy, by_class_names, repeated_blocks, shard_model
from phalanx.zero3.clip import clip_grad_norm_
from phalanx.zero3.hybrid import hybrid_mesh
from phalanx.zero3.meta_init import Materialized, has_meta_tensors, materialize
from phalanx.zero3.module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from phalanx.zero3.params import ShardUseError
from phalanx.zero3.policies import (
    CPUOffloadPolicy,
    DiskOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from phalanx.zero3.root import unit_of
from phalanx.zero3.state import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_state_dict,
    load_model_sharded,
    load_optimizer_sharded,
    model_state_to_save,
    optimizer_state_to_save,
    plain_optimizer_state,
    save_model_sharded,
    save_optimizer_sharded,
)
from phalanx.zero3.wrap import (
    fully_shard,
    is_sharded,
    redeal,
    shard_files,
    sharded_parameters,
    units,
)

__all__ = [
    "CPUOffloadPolicy",
    "DiskOffloadPolicy",
    "FSDPModule",
    "Materialized",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Policy",
    "ShardUseError",
    "UnshardHandle",
    "by_class_names",
    "clip_grad_norm_",
    "communication",
    "full_optimizer_state_dict",
    "full_state_dict",
    "fully_shard",
    "has_meta_tensors",
    "hybrid_mesh",
    "is_sharded",
    "load_full_state_dict",
    "load_model_sharded",
    "load_optimizer_sharded",
    "materialize",
    "model_state_to_save",
    "optimizer_state_to_save",
    "plain_optimizer_state",
    "redeal",
    "register_fsdp_forward_method",
    "repeated_blocks",
    "save_model_sharded",
    "save_optimizer_sharded",
    "shard_files",
    "shard_model",
    "sharded_parameters",
    "unit_of",
    "units",
]


def communication(model: nn.Module) -> Traffic:
    """Summed over the model's units (and its root's buffer broadcasts): the collectives,
    bytes and seconds waited of stage 3 so far, on this rank."""
    total = NO_TRAFFIC
    roots = set()  # units() gives each unit once, a group too
    for unit in units(model):
        total += unit.traffic
        if unit.root is not None and id(unit.root) not in roots:
            roots.add(id(unit.root))
            total += unit.root.comm.traffic
    return total
