"""Communication hooks: how a bucket's gradients travel between ranks.

Same contract as torch's `register_comm_hook`: a hook takes `(state, bucket)`
and returns a `torch.futures.Future` whose value is the reduced flat tensor
(already averaged). The reducer copies that value back into the bucket.

The state is torch's: a process group, or None for the default one. Pass a
`HookState(process_group)` instead and the hook also counts what it sent in
`state.stats` (a `CommStats`: `compression_ratio()` is bytes sent ÷ bytes of
the gradients). PowerSGD (`powersgd_hook`, `PowerSGDState`) lives in powersgd.py
and is exported here under torch's names too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from phalanx.ddp.comm_stats import (
    CommStats,
    HookState,
    all_reduce_counted,
    all_reduce_mean,
    count_gradients,
    divisor_of,
    process_group_of,
    stats_of,
)
from phalanx.ddp.powersgd import PowerSGDState, powerSGD_hook, powersgd_hook
from phalanx.errors import ConfigurationError

__all__ = [
    "CommHook",
    "CommStats",
    "GradBucket",
    "HookState",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "hook_by_name",
    "powerSGD_hook",
    "powersgd_hook",
]

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future[torch.Tensor]]


class GradBucket:
    """What a comm hook sees of one bucket: its flat buffer and parameters."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._gradients = gradients
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding this bucket's (summed, not yet averaged) gradients."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into `buffer()`, shaped like the parameters."""
        return self._gradients

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (launched last)."""
        return self._is_last


def allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in full precision: the reducer's own default path, as a hook."""
    group, stats = process_group_of(state), stats_of(state)
    count_gradients(stats, bucket.buffer(), bucket.is_last())
    return all_reduce_mean(bucket.buffer(), group, stats, divisor_of(state, group))


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        group, stats = process_group_of(state), stats_of(state)
        buffer = bucket.buffer()
        count_gradients(stats, buffer, bucket.is_last())
        compressed = buffer.to(dtype).div_(divisor_of(state, group))

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return all_reduce_counted(compressed, group, stats).then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = f"Halve the bytes on the wire: send gradients as {dtype}, average, restore."
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

HookName = Literal["allreduce", "fp16", "bf16", "powersgd"]


def hook_by_name(
    name: HookName, process_group: dist.ProcessGroup | None = None, **powersgd: Any
) -> tuple[HookState, CommHook]:
    """`(state, hook)` for `register_comm_hook`, with a state that counts bytes.

    For a Trainer option: `model.register_comm_hook(*hook_by_name(args.ddp_comm_hook,
    group, matrix_approximation_rank=...))`. Keyword arguments go to `PowerSGDState`.
    """
    if name == "powersgd":
        return PowerSGDState(process_group, **powersgd), powersgd_hook
    plain: dict[str, CommHook] = {
        "allreduce": allreduce_hook,
        "fp16": fp16_compress_hook,
        "bf16": bf16_compress_hook,
    }
    if name not in plain:
        raise ConfigurationError(
            f"unknown comm hook {name!r} — choose one of allreduce, fp16, bf16, powersgd"
        )
    if powersgd:
        raise ConfigurationError(
            f"PowerSGD options {sorted(powersgd)} given for the {name!r} hook — drop them, "
            "or choose 'powersgd'"
        )
    return HookState(process_group), plain[name]
