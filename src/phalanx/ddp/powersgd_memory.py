"""PowerSGD's memory: which gradients are compressed, and the state kept between steps.

A bucket's error feedback and warm-start Qs live in flat tensors laid out for
its current parameters (`BucketMemory`), and each parameter's share of them is
also published as a `ParamMemory` under the parameter's name. When a bucket's
parameters change (DDP's rebuild, or a resumed run), its new memory is filled
from the pieces, so state follows parameters, not bucket positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from phalanx.ddp.comm_hooks import GradBucket


@dataclass
class Batch:
    """Gradients of one shape compressed together: one (b, n, m) product per step."""

    members: list[int]  # indices into the bucket's gradients
    n: int
    m: int
    rank: int
    p_offset: int
    q_offset: int

    def q_numel(self) -> int:
        return len(self.members) * self.m * self.rank


@dataclass
class Plan:
    """How one bucket's gradients travel: which go plain, which are compressed in what order."""

    plain: list[int]
    batches: list[Batch]
    p_numel: int
    q_numel: int
    numel_before: int  # torch's compression_stats() counts, in elements
    numel_after: int


def make_plan(
    grads: list[torch.Tensor], max_rank: int, min_compression_rate: float, batched: bool
) -> Plan:
    """torch's split: a matrix is compressed when (n + m) r * min_compression_rate < n m;
    vectors and small matrices go plain. Compressed ones are grouped by shape, in first-seen
    order (torch's order, which decides which random numbers each Q starts from)."""
    plain: list[int] = []
    by_shape: dict[tuple[int, int], list[int]] = {}
    before = after = 0
    for j, grad in enumerate(grads):
        n = grad.shape[0] if grad.dim() else 1
        m = grad.numel() // max(n, 1)
        rank = min(n, m, max_rank)
        before += n * m
        if (n + m) * rank * min_compression_rate < n * m:
            by_shape.setdefault((n, m), []).append(j)
            after += (n + m) * rank
        else:
            plain.append(j)
            after += n * m
    batches: list[Batch] = []
    p_at = q_at = 0
    for (n, m), members in by_shape.items():
        rank = min(n, m, max_rank)
        groups = [members] if batched else [[j] for j in members]
        for group in groups:
            batches.append(Batch(group, n, m, rank, p_at, q_at))
            p_at += len(group) * n * rank
            q_at += len(group) * m * rank
    return Plan(plain, batches, p_at, q_at, before, after)


@dataclass
class ParamMemory:
    """One parameter's share of the state: views into its bucket's memory, or loaded tensors."""

    error: torch.Tensor | None
    q: torch.Tensor | None  # (m, r)


class BucketMemory:
    """Error feedback and P/Q storage of one bucket, laid out for its current parameters."""

    def __init__(
        self,
        bucket: GradBucket,
        keys: list[str],
        plan: Plan,
        pieces: dict[str, ParamMemory],
        error_feedback: bool,
    ) -> None:
        buffer, grads = bucket.buffer(), bucket.gradients()
        self.params = list(bucket.parameters())
        self.keys = keys
        self.plan = plan
        like: dict[str, Any] = {"device": buffer.device, "dtype": buffer.dtype}
        self.error = torch.zeros(buffer.numel(), **like) if error_feedback else None
        # The gradient plus error before compression, kept to compute the next error. Kept
        # between steps: a fresh bucket-sized tensor every step costs more than the copy.
        self.before = torch.empty_like(self.error) if self.error is not None else None
        self.p = torch.empty(self.plan.p_numel, **like)  # scratch: recomputed every step
        self.q = torch.empty(self.plan.q_numel, **like)
        self._slot = {j: (b, i) for b in self.plan.batches for i, j in enumerate(b.members)}
        self._offsets = [0]
        for grad in grads:
            self._offsets.append(self._offsets[-1] + grad.numel())
        # torch draws one seed per new bucket, Qs or not: so do we, or later buckets' Qs
        # would start from other numbers. A bucket refilled after a rebuild draws none.
        known = all(key in pieces for key in keys)
        self.needs_random_q = not (self._adopt(pieces) and known)
        for j, key in enumerate(keys):
            pieces[key] = ParamMemory(self._error_of(j), self._q_of(j))

    def holds(self, params: list[torch.Tensor]) -> bool:
        """True if laid out for exactly these parameters (identity: DDP's rebuild makes new
        buckets of the same parameters in another order)."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def _q_of(self, j: int) -> torch.Tensor | None:
        if j not in self._slot:
            return None
        batch, i = self._slot[j]
        start = batch.q_offset + i * batch.m * batch.rank
        return self.q[start : start + batch.m * batch.rank].view(batch.m, batch.rank)

    def _error_of(self, j: int) -> torch.Tensor | None:
        return None if self.error is None else self.error[self._offsets[j] : self._offsets[j + 1]]

    def _adopt(self, pieces: dict[str, ParamMemory]) -> bool:
        """Fill from earlier pieces of these parameters; True if every Q was there."""
        every_q = True
        for j, key in enumerate(self.keys):
            piece = pieces.get(key, ParamMemory(None, None))
            error, q = self._error_of(j), self._q_of(j)
            # A piece of another size is not this parameter's (positional keys, torch's DDP).
            if (
                error is not None
                and piece.error is not None
                and piece.error.numel() == error.numel()
            ):
                error.copy_(piece.error.reshape(-1))
            if q is not None:
                if piece.q is not None and piece.q.shape == q.shape:
                    q.copy_(piece.q)
                else:
                    every_q = False
        return every_q
