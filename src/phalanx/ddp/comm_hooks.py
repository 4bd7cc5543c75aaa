"""Communication hooks: how a bucket's gradients travel between ranks.

Same contract as torch's `register_comm_hook`: a hook takes `(state, bucket)`
and returns a `torch.futures.Future` whose value is the reduced flat tensor
(already averaged). The reducer copies that value back into the bucket.

A hook may tell the reducer's counters what it really sends with
`bucket.record_sent(nbytes, world_size)` (once per collective, before its
future completes); phalanx's own hooks do. A hook that does not (torch's) is
counted as an all-reduce of the whole bucket, and `reducer.stats.hook_bytes`
says "bucket".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.ddp.stats import Collective, Traffic

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
        self.sent: Traffic | None = None
        """What the hook reported it sent for this bucket (None: it reported nothing)."""

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

    def record_sent(
        self, nbytes: int, world_size: int, collective: Collective = Collective.ALL_REDUCE
    ) -> None:
        """Count one collective this hook issues for the bucket (phalanx only, not torch)."""
        more = Traffic.of(collective, world_size, gradient_bytes=nbytes)
        if self.sent is not None:
            more = Traffic(
                self.sent.collectives + 1,
                self.sent.gradient_bytes + nbytes,
                0,
                self.sent.wire_bytes + more.wire_bytes,
            )
        self.sent = more


def _group(state: Any) -> dist.ProcessGroup | None:
    """torch's convention: the hook state is a process group, or None for the default one."""
    return state if isinstance(state, dist.ProcessGroup) else dist.group.WORLD


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in full precision: the reducer's own default path, as a hook."""
    group = _group(state)
    world_size = dist.get_world_size(group)
    tensor = bucket.buffer().div_(world_size)
    bucket.record_sent(tensor.numel() * tensor.element_size(), world_size)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = _group(state)
        buffer = bucket.buffer()
        world_size = dist.get_world_size(group)
        compressed = buffer.to(dtype).div_(world_size)
        bucket.record_sent(compressed.numel() * compressed.element_size(), world_size)
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return work.get_future().then(decompress)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    hook.__doc__ = f"Halve the bytes on the wire: send gradients as {dtype}, average, restore."
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)
