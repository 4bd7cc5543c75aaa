"""Parameters that a forward leaves out of the graph: found before backward, handled after.

With `find_unused_parameters=True` (or `static_graph=True`) the reducer must
know, before backward, which parameters will get no gradient this iteration:
their buckets would otherwise never fill and every rank would wait forever.
`find_unused_parameters` walks the graph from the outputs after every forward.
`static_graph` does not walk it at all (a walk cannot see into a reentrant
checkpoint, whose forward kept no graph): its first backward counts which
parameters got gradients (phalanx.ddp.static_graph), and that set stays.
They are marked ready at the start of backward (zeros, or the gradient they
accumulated under no_sync), and after the reduction the used map tells which
of them no rank used at all: those keep their local `.grad` (or None), as in
torch DDP, instead of a meaningless average of zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.runtime.nested import iter_tensors

if TYPE_CHECKING:
    from phalanx.ddp.buckets import Bucket
    from phalanx.ddp.signals import StepSignals


def reachable_leaves(outputs: Any) -> set[int]:
    """The `id()`s of the leaf tensors whose AccumulateGrad the outputs' graph reaches."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    stack = [t.grad_fn for t in iter_tensors(outputs) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


class UnusedParameters:
    """The graph search, the used map, and the local gradients kept for unused parameters."""

    def __init__(
        self, params: Sequence[torch.Tensor], find_unused: bool, static_graph: bool
    ) -> None:
        self.tracked = find_unused or static_graph
        """Whether unused parameters are searched for (and the used map exchanged) at all."""
        self.static_graph = static_graph
        """Unused parameters are learnt once, from static_graph's first backward."""
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self.now: list[int] = []
        """This iteration's unused parameters (indices), sorted."""
        self.used = bytearray(len(params))
        """1 where the parameter got a gradient since the last reduction (written by the hook)."""
        self.last_used = bytearray(len(params))
        """1 where some rank used the parameter in the last reduction this rank took part
        in, or in one it shadowed since (see `remember`)."""
        self._saved: dict[int, torch.Tensor] = {}

    def search(self, outputs: Any) -> None:
        """After a synced forward: which parameters the outputs' graph does not reach."""
        if not self.tracked or self.static_graph:
            return  # static_graph: `now` is what `set_static` was given (nothing before that)
        reached = reachable_leaves(outputs)
        self.now = sorted(i for p, i in self._index_of.items() if p not in reached)

    def make_static(self) -> None:
        """`_set_static_graph()` after construction: stop searching, learn from the counts."""
        self.static_graph = self.tracked = True
        self.now = []

    def set_static(self, unused: list[int]) -> None:
        """static_graph: the parameters its first backward gave no gradient, for good."""
        self.now = sorted(unused)

    def save_local(self, i: int, grad: torch.Tensor) -> None:
        """Keep a copy of a gradient that lives in its bucket slot (gradient_as_bucket_view):
        the collective overwrites the slot, and if no rank used the parameter the local
        value must come back."""
        self._saved[i] = grad.clone()

    def unused_everywhere(self, used_counts: list[int] | None, here: Iterable[int]) -> set[int]:
        """Of this rank's unused parameters (`here`), those that no rank gave a gradient."""
        if used_counts is None:
            return set()
        return {i for i in here if used_counts[i] == 0}

    def restore_saved(self, slot_of: Callable[[int], torch.Tensor], unused: set[int]) -> None:
        """Put back the local gradient of every saved parameter that no rank used."""
        for i, saved in self._saved.items():
            if i in unused:
                slot_of(i).copy_(saved)

    def remember(self, used_counts: list[int], shadowed: bool) -> None:
        """Keep which parameters some rank used, for the used map a rank out of batches
        sends under Join. torch's joined rank all-reduces its device-side used map in
        place, which still holds the counts of its last real iteration and then grows
        with every shadowed one: a parameter used then counts as used in every
        iteration it shadows. Parity with torch's Join needs the same map."""
        for i, count in enumerate(used_counts):
            if count:
                self.last_used[i] = 1
            elif not shadowed:
                self.last_used[i] = 0

    def end_iteration(self) -> None:
        self.used[:] = bytes(len(self.used))
        self._saved.clear()


class BucketSkips:
    """skip_all_reduce_unused_params: the buckets that no rank uses this time, agreed.

    torch skips the buckets unused on *this* rank and hangs if another rank
    used them; agreeing first (one small all-reduce after forward) skips only
    what is unused everywhere, so a rank that differs costs bandwidth, not a
    deadlock. Under static_graph the set never changes: agreed once per bucket
    layout.
    """

    def __init__(self, enabled: bool, unused: UnusedParameters, signals: StepSignals) -> None:
        self.enabled = enabled
        self.unused = unused
        self.signals = signals
        self.skipped: frozenset[int] = frozenset()
        """Bucket indices not sent this iteration."""
        self._agreed_for: list[Bucket] | None = None

    def due(self, buckets: list[Bucket]) -> bool:
        """Whether this iteration agrees on the skipped buckets (the same on every rank)."""
        if not self.enabled or not self.unused.tracked:
            return False
        return not (self.unused.static_graph and self._agreed_for is buckets)

    def agree(self, buckets: list[Bucket], unused_here: set[int]) -> None:
        """One small all-reduce: which buckets hold only parameters unused on every rank."""
        mine = [all(i in unused_here for i in b.param_indices) for b in buckets]
        everywhere = self.signals.agree(mine)
        self.skipped = frozenset(k for k, skip in enumerate(everywhere) if skip)
        self._agreed_for = buckets
