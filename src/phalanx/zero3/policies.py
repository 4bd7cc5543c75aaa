"""FSDP2's policy objects, by its names: mixed precision, and where sharded state lives
(the offload policies are phalanx.offload's: stages 1-2 use them too).

A script written for torch's FSDP2 passes these (its own classes or ours:
both are read by field name), so each field is honoured or refused by name,
never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from phalanx.errors import ConfigurationError
from phalanx.offload.policies import CPUOffloadPolicy, DiskOffloadPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "DiskOffloadPolicy",
    "MixedPrecisionLike",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "mixed_precision",
    "offload",
]


class MixedPrecisionLike(Protocol):
    """What a mixed-precision policy has: phalanx's, or torch's own (read by field name)."""

    @property
    def param_dtype(self) -> torch.dtype | None: ...
    @property
    def reduce_dtype(self) -> torch.dtype | None: ...
    @property
    def output_dtype(self) -> torch.dtype | None: ...
    @property
    def cast_forward_inputs(self) -> bool: ...


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision, module by module.

    `param_dtype`: the unsharded parameters' dtype, so the all-gather and the
    compute run in it; the sharded parameters (what the optimizer steps) keep
    theirs. `reduce_dtype`: the gradient reduction's dtype; None with a
    `param_dtype` reduces in `param_dtype` (FSDP2's rule). `output_dtype`: floating
    outputs of the module's forward are cast to it. `cast_forward_inputs`: floating
    inputs are cast to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def gradient_dtype(self, unsharded: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in, for unsharded parameters of `unsharded`."""
        return self.reduce_dtype or self.param_dtype or unsharded


def mixed_precision(policy: MixedPrecisionLike | object | None) -> MixedPrecisionPolicy:
    """Ours or torch's (`torch.distributed.fsdp.MixedPrecisionPolicy`), read by field name."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    names = [f.name for f in fields(MixedPrecisionPolicy)]
    if not all(hasattr(policy, n) for n in names):
        raise ConfigurationError(
            f"mp_policy={policy!r} is not a MixedPrecisionPolicy — pass "
            "phalanx.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)"
        )
    return MixedPrecisionPolicy(**{n: getattr(policy, n) for n in names})


def offload(policy: object | None, device: torch.device) -> OffloadPolicy:
    """`OffloadPolicy()` (none), `CPUOffloadPolicy` (ours or torch's; pinning only off a
    CPU mesh) or `DiskOffloadPolicy`."""
    if policy is None:
        return OffloadPolicy()
    kind = type(policy).__name__
    if kind == "OffloadPolicy":
        return OffloadPolicy()
    if isinstance(policy, DiskOffloadPolicy):
        return policy
    if kind == "CPUOffloadPolicy":
        pin = bool(getattr(policy, "pin_memory", True)) and device.type != "cpu"
        return CPUOffloadPolicy(pin_memory=pin)
    raise ConfigurationError(
        f"offload_policy={policy!r} is not an OffloadPolicy — pass phalanx.OffloadPolicy(), "
        "phalanx.CPUOffloadPolicy() or phalanx.DiskOffloadPolicy(path)"
    )
