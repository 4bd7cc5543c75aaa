"""torch 2.13's DistributedDataParallel arguments: resolved to what the reducer uses, or refused.

A script moving from torch may pass any argument torch's constructor takes.
Each one either means something for our reducer and is honoured, or it is
refused with an error that names it and says why: none is silently ignored
(docs/ddp.md has the whole table).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from phalanx.ddp.buckets import MIB, default_caps
from phalanx.errors import ConfigurationError, NotSupportedError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_BUCKET_CAP_MB = 25.0


def refuse_unsupported(
    mixed_precision: object,
    delay_all_reduce_named_params: object,
    param_to_hook_all_reduce: object,
) -> None:
    """The arguments whose feature phalanx does not implement, when they ask for it."""
    if mixed_precision is not None:
        raise NotSupportedError(
            "mixed_precision is torch's experimental DDP-native mixed precision (low-precision "
            "parameter copies for forward, kept in step by extra hooks), which phalanx's reducer "
            "does not implement — train under torch.autocast instead, and for reduced-precision "
            "communication register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)"
        )
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotSupportedError(
            "delay_all_reduce_named_params / param_to_hook_all_reduce start a second, "
            "hook-timed all-reduce outside the reducer's ordered buckets, which phalanx does "
            "not have — drop both to reduce those parameters with the others, or keep their "
            "gradients local with DistributedDataParallel._set_params_and_buffers_to_ignore_"
            "for_model(module, names)"
        )


def resolve_group(
    process_group: dist.ProcessGroup | None, device_mesh: DeviceMesh | None
) -> dist.ProcessGroup:
    """The group to average over: `process_group`, a 1-D `device_mesh`'s, or the default one."""
    if device_mesh is None:
        return process_group if process_group is not None else world_group()
    if process_group is not None:
        raise ConfigurationError(
            "both process_group and device_mesh were passed — pass one of them"
        )
    if device_mesh.ndim != 1:
        raise ConfigurationError(
            f"device_mesh has {device_mesh.ndim} dimensions; DistributedDataParallel averages "
            "over one — pass the data-parallel slice, e.g. mesh['dp']"
        )
    root = device_mesh._get_root_mesh()
    if root is not device_mesh and root.ndim != 1:
        raise NotSupportedError(
            "device_mesh is a slice of a larger mesh, torch's recipe for DDP over "
            "tensor-parallel (DTensor) parameters, which phalanx does not support — pass a "
            "mesh of its own (init_device_mesh(device, (world_size,))) or a process_group"
        )
    group: dist.ProcessGroup = device_mesh.get_group(mesh_dim=0)
    return group


def world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None  # the callers checked dist.is_initialized()
    return group


def _mib_to_bytes(name: str, value: Any) -> int:
    try:
        mib = float(value)
    except (TypeError, ValueError):
        mib = math.nan
    if not math.isfinite(mib) or mib <= 0:
        raise ConfigurationError(
            f"{name} must be a finite number of MiB > 0, got {value!r} — the default is "
            f"{DEFAULT_BUCKET_CAP_MB:g}"
        )
    return max(1, int(mib * MIB))


AUTO = "auto"
"""bucket_cap_mb="auto": measure a few sizes during the first steps (phalanx.ddp.autotune)."""


def tuned(bucket_cap_mb: float | str | None, bucket_cap_mb_list: Sequence[float] | None) -> bool:
    """Whether the bucket size is tuned in the first steps: "auto", and no list given (a
    list sets every size, and wins, as `bucket_caps` says)."""
    return bucket_cap_mb == AUTO and not bucket_cap_mb_list


def bucket_caps(
    bucket_cap_mb: float | str | None, bucket_cap_mb_list: Sequence[float] | None
) -> list[int]:
    """Byte caps of the buckets in launch order (the last repeats); see `assign_buckets`.

    `bucket_cap_mb_list`, as in torch: bucket k holds up to `list[k]` MiB, the
    rest up to the last entry, with no separate small first bucket.
    """
    if bucket_cap_mb_list is not None and len(bucket_cap_mb_list) > 0:
        if bucket_cap_mb not in (None, DEFAULT_BUCKET_CAP_MB, AUTO):
            raise ConfigurationError(
                f"both bucket_cap_mb={bucket_cap_mb} and bucket_cap_mb_list were passed; the "
                "list sets every bucket's size — pass one of them"
            )
        return [_mib_to_bytes("bucket_cap_mb_list entry", mb) for mb in bucket_cap_mb_list]
    if bucket_cap_mb == AUTO:  # the default until the measurement picks a size
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    return default_caps(_mib_to_bytes("bucket_cap_mb", cap_mb))


def check_skip_unused(skip: bool, find_unused_parameters: bool, static_graph: bool) -> None:
    if skip and not (find_unused_parameters or static_graph):
        raise ConfigurationError(
            "skip_all_reduce_unused_params=True needs find_unused_parameters=True (or "
            "static_graph=True): without it the reducer does not know which parameters are "
            "unused — pass one of them, or drop skip_all_reduce_unused_params"
        )


def warn_deprecated(check_reduction: bool) -> None:
    """`check_reduction` is deprecated and ignored by torch too: said once, as torch does."""
    if check_reduction:
        warnings.warn(
            "DistributedDataParallel's check_reduction argument is deprecated (torch ignores "
            "it too): the reducer always checks that every gradient arrived — drop it",
            FutureWarning,
            stacklevel=3,
        )


def buffer_sync(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """(before each synced forward, at wrap): whether rank 0's buffers are broadcast.

    torch 2.13's rule: buffers are synced at wrap unless broadcast_buffers=False
    alone says not to; `forward_sync_buffers` (its new name) only governs the
    forward sync, and when given the wrap always syncs.
    """
    broadcast = True if broadcast_buffers is None else broadcast_buffers
    if forward_sync_buffers is None:
        return broadcast, broadcast
    return forward_sync_buffers, True


def collective_settings(
    bucket_caps: Sequence[int],
    tune_bucket_size: bool,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    forward_sync_buffers: bool,
) -> dict[str, object]:
    """What shapes a DDP wrapper's collectives: every rank must agree (checked at wrap)."""
    return {
        "wrapper": "phalanx.DistributedDataParallel",
        "bucket_cap_mb (bucket sizes in MiB)": (
            "auto" if tune_bucket_size else [c / 2**20 for c in bucket_caps]
        ),
        "find_unused_parameters": find_unused_parameters,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "static_graph": static_graph,
        "buffer broadcast (broadcast_buffers)": forward_sync_buffers,
    }


def require_process_group() -> None:
    """DDP needs the group first: refused in one line naming the call to make."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            "torch.distributed is not initialised — call phalanx.init() (or "
            "torch.distributed.init_process_group) before wrapping the model in "
            "DistributedDataParallel"
        )
