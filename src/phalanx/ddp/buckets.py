"""Bucket assignment, and the bucket: one flat buffer that is reduced as a whole.

Gradients are reduced in buckets rather than one by one: a few large
collectives cost far less than hundreds of small ones, and a bucket can be
sent as soon as its last gradient is ready, while backward is still running.
A `Bucket` owns its life in one iteration: gradients marked ready into their
slots, the launch of its collective once full, the wait, and the write-back
to `.grad`. What the collective *is* belongs to a `BucketReduction`
(phalanx.ddp.reductions), which the bucket only calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from phalanx.ddp.reductions import BucketReduction, InFlight

MIB = 1024 * 1024
# The first bucket is small so the first all-reduce starts as early as possible
# in backward; torch DDP uses the same 1 MiB.
FIRST_BUCKET_BYTES = 1 * MIB
# A bucket whose parameters average at most this many bytes fills its slots all at
# once when it launches: below it, a Python copy per gradient costs more dispatch than
# a second pass over the bytes (benchmarks/hook_path.py measures the hook path).
SMALL_PARAM_BYTES = 16 * 1024


def default_caps(cap_bytes: int) -> list[int]:
    """Bucket caps for `bucket_cap_mb`: a small first bucket, then `cap_bytes` each."""
    return [min(FIRST_BUCKET_BYTES, cap_bytes), cap_bytes]


def assign_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]
) -> list[list[int]]:
    """Group parameter indices into buckets, walking `order` (expected gradient arrival).

    Parameters of different (device, dtype) never share a bucket, since one flat
    buffer holds one dtype on one device. Each (device, dtype) stream fills its
    open bucket up to its cap: its k-th bucket closes at `caps[k]`, and every
    bucket after the last cap at that last cap (torch's rule for its limit
    lists, `bucket_cap_mb_list`). The buckets are returned sorted by the
    position of their first parameter in `order`, which is the order they are
    launched in on every rank.
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
        closed = closed_per_key.get(key, 0)
        if open_sizes[key] >= caps[min(closed, len(caps) - 1)]:
            done.append(bucket)
            del open_buckets[key]
            open_sizes[key] = 0
            closed_per_key[key] = closed + 1
    done.extend(b for b in open_buckets.values() if b)
    position = {index: pos for pos, index in enumerate(order)}
    done.sort(key=lambda b: position[b[0]])
    return done


class Bucket:
    """One flat gradient buffer, the parameters whose gradients live in it, and its collective.

    `views[slot]` is shaped like `params[slot]` and aliases its part of
    `buffer`, so filling a slot (or, with gradient_as_bucket_view, using the
    view as the `.grad` itself) needs no offset arithmetic on the hot path.
    """

    __slots__ = (
        "buffer",
        "copy_on_ready",
        "deferred",
        "fill_at_launch",
        "flags",
        "grad_bytes",
        "grads",
        "grads_in_views",
        "index",
        "is_last",
        "keeps_gradients",
        "missing",
        "param_indices",
        "params",
        "pending",
        "reduction_state",
        "scale",
        "views",
        "work",
    )

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: Sequence[torch.Tensor],
        *,
        is_last: bool,
        flag_slots: int,
        grads_in_views: bool,
        keeps_gradients: bool = True,
        deferred: bool = False,
    ) -> None:
        self.index = index
        """Launch position: every rank launches bucket k before bucket k + 1."""
        self.param_indices = list(param_indices)
        """Each slot's parameter, as an index into the reducer's parameter list."""
        self.params = [params[i] for i in param_indices]
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        """Bytes of this bucket's gradients (what a reduction sends, flag slots aside)."""
        self.keeps_gradients = keeps_gradients
        """False: no buffer at all; the bucket only counts readiness, and the reduction
        reads each `.grad` at launch (sharded gradients need no full-size copy)."""
        self._allocate(flag_slots if keeps_gradients else 0)
        self.is_last = is_last
        self.grads_in_views = grads_in_views
        """gradient_as_bucket_view: `.grad` is the slot itself, accumulated in place."""
        self.deferred = deferred and keeps_gradients
        """batched_grad_copy: slots are filled all at once when the bucket launches (one
        `_foreach_copy_` and one division per bucket instead of one copy per gradient)."""
        small = self.grad_bytes <= SMALL_PARAM_BYTES * len(self.params)
        self.fill_at_launch = self.deferred or (keeps_gradients and small and not grads_in_views)
        """Slots filled at launch: batched_grad_copy's raw sums, or a bucket of small
        parameters, whose slots then get the same `scale` x gradient as copies in the
        hooks would give (the same float multiply, bit for bit)."""
        self.copy_on_ready = keeps_gradients and not self.fill_at_launch
        """Whether `mark_ready` fills the slot (the hook path reads one attribute)."""
        self.scale: torch.Tensor | None = None
        """Multiply gradients by this on their way into the slots (None: copy them as they are)."""
        self.pending = len(self.params)
        """Slots still waiting for their gradient in this iteration; launched at zero."""
        self.missing: set[int] = set()
        """Slots whose gradient never came this iteration: zeros, whatever `.grad` holds."""
        self.work: InFlight[Any] | None = None
        """The collective the reduction started, until the bucket is finished."""
        self.reduction_state: object = None
        """The reduction's own precomputed data for this bucket (e.g. a wire layout)."""

    def _allocate(self, flag_slots: int) -> None:
        """The flat buffer, and each slot's view of it (none when gradients are not kept)."""
        total = sum(p.numel() for p in self.params) if self.keeps_gradients else 0
        first = self.params[0]
        self.buffer = torch.zeros(total + flag_slots, dtype=first.dtype, device=first.device)
        """What a reduction may send whole: the gradients, then any flag slots."""
        self.grads = self.buffer[:total]
        """The gradient part of `buffer`."""
        self.flags = self.buffer[total:]
        """One slot per rank after the gradients (phalanx.ddp.signals), last bucket only."""
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params if self.keeps_gradients else ():
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    @property
    def scaled(self) -> bool:
        """Whether the slots hold `scale` x the gradients once filled (False: raw sums)."""
        return self.scale is not None and not self.grads_in_views and not self.deferred

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        if self.missing:
            self.missing = set()

    # ------------------------------------------------------------- one iteration
    def mark_ready(self, slot: int, param: torch.Tensor) -> bool:
        """Put `param`'s gradient (None: zeros) in its slot; True once every slot is filled."""
        if self.copy_on_ready:
            grad = param.grad
            view = self.views[slot]
            if grad is None:
                view.zero_()
            elif self.grads_in_views:
                if grad is not view:
                    view.copy_(grad)
                    param.grad = view
            elif self.scale is None:
                view.copy_(grad)
            else:
                # Average while copying, as torch DDP does: no second pass over the bucket.
                torch.mul(grad, self.scale, out=view)
        self.pending -= 1
        return self.pending == 0

    def mark_missing(self, slot: int) -> None:
        """A gradient that never came: send zeros, so the collective still happens."""
        if self.keeps_gradients:
            self.views[slot].zero_()
            if self.fill_at_launch:
                self.missing.add(slot)
        self.pending -= 1

    def accumulate_in_view(self, slot: int, param: torch.Tensor) -> None:
        """no_sync() with gradient_as_bucket_view: keep `.grad` living in its slot."""
        view = self.views[slot]
        if param.grad is not None and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def launch(self, reduction: BucketReduction[Any]) -> None:
        if self.fill_at_launch:
            self.fill_slots()
        self.work = reduction.start(self)

    def fill_slots(self) -> None:
        """Every slot from its `.grad` at once (None: zeros); scaled as `scaled` says."""
        grads = [p.grad for p in self.params]
        if not (self.missing or self.grads_in_views) and all(g is not None for g in grads):
            # The usual step, without a per-slot Python loop (hundreds of slots here).
            torch._foreach_copy_(self.views, grads)  # type: ignore[arg-type]
        else:
            self._fill_slots_one_by_one()
        if self.scaled and self.scale is not None:
            self.grads.mul_(self.scale)

    def _fill_slots_one_by_one(self) -> None:
        """Missing slots stay zero, a None `.grad` sends zeros, and with gradient_as_bucket_view
        each `.grad` moves into its slot."""
        copied: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for slot, (p, view) in enumerate(zip(self.params, self.views)):
            if slot in self.missing:
                continue  # zeroed by mark_missing
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:
                copied.append((p, view, p.grad))
        if copied:
            torch._foreach_copy_([view for _, view, _ in copied], [grad for _, _, grad in copied])
        if self.grads_in_views:
            for p, view, _ in copied:
                p.grad = view

    def wait(self) -> None:
        """Block until this bucket's collective is done and `grads` holds the result."""
        if self.work is not None:
            self.work.finish(self)
            self.work = None

    def write_back(self, skip: set[int]) -> None:
        """Hand the reduced slots to `.grad`, except for parameters in `skip` (by index)."""
        if self.grads_in_views:
            for i, p, view in zip(self.param_indices, self.params, self.views):
                if p.grad is None and i not in skip:
                    p.grad = view  # an unused parameter that had no .grad yet
            return
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, p, view in zip(self.param_indices, self.params, self.views):
            if i in skip:
                continue
            if p.grad is None:
                p.grad = view.clone()
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)

    def bind_grads_to_views(self) -> None:
        """gradient_as_bucket_view after a (re)build: move existing `.grad`s into the slots."""
        for slot, p in enumerate(self.params):
            self.accumulate_in_view(slot, p)
