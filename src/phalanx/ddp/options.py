"""`DDPOptions`: the tunable DistributedDataParallel arguments, as one value.

A Trainer fills it from `TrainingArguments.ddp_options()` and wraps the model
with `DistributedDataParallel(model, device_ids=..., process_group=...,
**asdict(options))`. Runtime objects (devices, the process group) are passed
beside it, never stored in it. Names and defaults are DDP's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.ddp.module import DEFAULT_BUCKET_CAP_MB


@dataclass(kw_only=True, frozen=True, slots=True)
class DDPOptions:
    """DistributedDataParallel keyword arguments, every one resolved to a concrete value."""

    bucket_cap_mb: float | str = DEFAULT_BUCKET_CAP_MB
    """Size of the gradient buckets all-reduced together, in MiB, or "auto"."""
    find_unused_parameters: bool = False
    """Search the autograd graph after each forward for parameters that will get no gradient."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before each training forward."""
