"""Bucket assignment and the flat buffers the reducer all-reduces.

Gradients are reduced in buckets rather than one by one: a few large
all-reduces cost far less than hundreds of small ones, and a bucket can be
sent as soon as its last gradient is ready, while backward is still running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIB = 1024 * 1024
# The first bucket is small so the first all-reduce starts as early as possible
# in backward; torch DDP uses the same 1 MiB.
FIRST_BUCKET_BYTES = 1 * MIB


def assign_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Group parameter indices into buckets, walking `order` (expected gradient arrival).

    Parameters of different (device, dtype) never share a bucket, since one flat
    buffer holds one dtype on one device. Each (device, dtype) stream fills its
    open bucket up to its cap (the first one up to `first_cap_bytes`). The
    buckets are returned sorted by the position of their first parameter in
    `order`, which is the order they are launched in on every rank.
    """
    open_buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    open_sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed_per_key: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[int]] = []
    for index in order:
        p = params[index]
        key = (p.device, p.dtype)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_sizes[key] = open_sizes.get(key, 0) + p.numel() * p.element_size()
        cap = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if open_sizes[key] >= cap:
            done.append(bucket)
            del open_buckets[key]
            open_sizes[key] = 0
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
    done.extend(b for b in open_buckets.values() if b)
    position = {index: pos for pos, index in enumerate(order)}
    done.sort(key=lambda b: position[b[0]])
    return done


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    `views[i]` is shaped like `params[i]` and aliases its slice of `buffer`, so
    copying a gradient in (or, with gradient_as_bucket_view, using the view as
    the `.grad` itself) needs no offset arithmetic on the hot path.
    """

    index: int
    param_indices: list[int]
    params: list[torch.Tensor]
    buffer: torch.Tensor  # what the all-reduce sends: gradients, then any flag slots
    grads: torch.Tensor  # the gradient part of `buffer`
    views: list[torch.Tensor]
    flags: torch.Tensor  # one slot per rank after the gradients (last bucket only)
    # Gradients still missing in this iteration; the bucket is launched at zero.
    pending: int = 0
    # The in-flight all-reduce: a torch Work, or a Future when a comm hook runs.
    work: object | None = None
    # Positions in `params` of the parameters marked ready without a gradient.
    missing_grad: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.missing_grad.clear()


def make_bucket(
    index: int, param_indices: list[int], params: Sequence[torch.Tensor], flag_slots: int = 0
) -> Bucket:
    """Allocate the flat buffer for `param_indices` and carve one view per parameter.

    `flag_slots` extra elements ride along with the gradients: a rank that
    cannot finish the iteration raises its slot, so every rank learns of it
    from the same all-reduce instead of waiting forever for the missing rank.
    """
    members = [params[i] for i in param_indices]
    total = sum(p.numel() for p in members)
    first = members[0]
    buffer = torch.zeros(total + flag_slots, dtype=first.dtype, device=first.device)
    views = []
    offset = 0
    for p in members:
        views.append(buffer[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    grads, flags = buffer[:total], buffer[total:]
    bucket = Bucket(index, list(param_indices), members, buffer, grads, views, flags)
    bucket.reset()
    return bucket
