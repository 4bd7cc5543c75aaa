"""phalanx: data-parallel training for PyTorch.

Public names load lazily so that `phalanx launch` (which must never import
torch: it starts fast and holds no GPU) can live in this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phalanx.errors import (
    ConfigurationError,
    NotSupportedError,
    PhalanxError,
    ReducerError,
    UnevenInputsError,
)

if TYPE_CHECKING:
    from phalanx.data.sampler import DistributedSampler
    from phalanx.ddp import comm_hooks
    from phalanx.ddp.join import Join
    from phalanx.ddp.module import DistributedDataParallel
    from phalanx.diagnostics.replicas import check_replicas
    from phalanx.offload import DiskOffloadPolicy, offload_optimizer
    from phalanx.optim.diloco import DiLoCo
    from phalanx.optim.local_sgd import LocalSGD
    from phalanx.optim.zero import ZeroRedundancyOptimizer
    from phalanx.runtime import World, init, launched_by_launcher, shutdown
    from phalanx.train import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
    from phalanx.zero3 import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        UnshardHandle,
        fully_shard,
        materialize,
        register_fsdp_forward_method,
    )

__version__ = "0.1.0"

_LAZY: dict[str, tuple[str, str | None]] = {
    "init": ("phalanx.runtime", "init"),
    "shutdown": ("phalanx.runtime", "shutdown"),
    "World": ("phalanx.runtime", "World"),
    "launched_by_launcher": ("phalanx.runtime", "launched_by_launcher"),
    "Trainer": ("phalanx.train", "Trainer"),
    "TrainingArguments": ("phalanx.train", "TrainingArguments"),
    "TrainerCallback": ("phalanx.train", "TrainerCallback"),
    "EarlyStoppingCallback": ("phalanx.train", "EarlyStoppingCallback"),
    "DistributedDataParallel": ("phalanx.ddp.module", "DistributedDataParallel"),
    "DistributedSampler": ("phalanx.data.sampler", "DistributedSampler"),
    "Join": ("phalanx.ddp.join", "Join"),
    "comm_hooks": ("phalanx.ddp.comm_hooks", None),
    "ZeroRedundancyOptimizer": ("phalanx.optim.zero", "ZeroRedundancyOptimizer"),
    "LocalSGD": ("phalanx.optim.local_sgd", "LocalSGD"),
    "DiLoCo": ("phalanx.optim.diloco", "DiLoCo"),
    "fully_shard": ("phalanx.zero3", "fully_shard"),
    "materialize": ("phalanx.zero3", "materialize"),
    "check_replicas": ("phalanx.diagnostics.replicas", "check_replicas"),
    "MixedPrecisionPolicy": ("phalanx.zero3", "MixedPrecisionPolicy"),
    "FSDPModule": ("phalanx.zero3", "FSDPModule"),
    "OffloadPolicy": ("phalanx.zero3", "OffloadPolicy"),
    "CPUOffloadPolicy": ("phalanx.zero3", "CPUOffloadPolicy"),
    "DiskOffloadPolicy": ("phalanx.offload", "DiskOffloadPolicy"),
    "offload_optimizer": ("phalanx.offload", "offload_optimizer"),
    "UnshardHandle": ("phalanx.zero3", "UnshardHandle"),
    "register_fsdp_forward_method": ("phalanx.zero3", "register_fsdp_forward_method"),
}

__all__ = [
    "CPUOffloadPolicy",
    "ConfigurationError",
    "DiLoCo",
    "DiskOffloadPolicy",
    "DistributedDataParallel",
    "DistributedSampler",
    "EarlyStoppingCallback",
    "FSDPModule",
    "Join",
    "LocalSGD",
    "MixedPrecisionPolicy",
    "NotSupportedError",
    "OffloadPolicy",
    "PhalanxError",
    "ReducerError",
    "Trainer",
    "TrainerCallback",
    "TrainingArguments",
    "UnevenInputsError",
    "UnshardHandle",
    "World",
    "ZeroRedundancyOptimizer",
    "check_replicas",
    "comm_hooks",
    "fully_shard",
    "init",
    "launched_by_launcher",
    "materialize",
    "offload_optimizer",
    "register_fsdp_forward_method",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
