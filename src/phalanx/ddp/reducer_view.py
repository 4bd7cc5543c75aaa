"""The narrow view of a DDP reducer that a ZeroRedundancyOptimizer is handed.

ZeRO needs three things of the reducer that averages its parameters'
gradients, and nothing else: to check that every parameter the reducer
hooks is one of its own (stage 2 has nowhere else to put a gradient), to
replace each bucket's all-reduce by a reduce-scatter into its shards (stage
2), and to tell Join that its step is a collective of its own. The Trainer's
strategy (or a user) hands it `ReducerView(ddp.reducer)` explicitly; the
reducer's internals stay its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.ddp.reducer import Reducer
from phalanx.ddp.reductions import BucketReduction, CommHookReduction
from phalanx.errors import ConfigurationError


class ReducerView:
    """What a ZeroRedundancyOptimizer may do with the reducer of its parameters."""

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReducerView) and other._reducer is self._reducer

    def __hash__(self) -> int:
        return id(self._reducer)

    @property
    def group(self) -> dist.ProcessGroup:
        """The ranks it averages over."""
        return self._reducer.group

    def hooks(self, params: Iterable[torch.Tensor]) -> list[bool]:
        """For each of `params`: whether this reducer averages its gradient."""
        mine = {id(p) for p in self._reducer.params}
        return [id(p) in mine for p in params]

    def require_within(self, params: Iterable[torch.Tensor]) -> None:
        """Refuse a reducer that hooks a parameter outside `params` (stage 2 would have
        nowhere to put its reduced gradient)."""
        given = {id(p) for p in params}
        reducer = self._reducer
        outside = [name for name, p in zip(reducer.names, reducer.params) if id(p) not in given]
        if outside:
            raise ConfigurationError(
                f"shard_gradients=True: parameter '{outside[0]}' (and {len(outside) - 1} more) of "
                "the wrapped model is not in this optimizer, so its reduced gradient would have "
                "nowhere to go — give the optimizer every trainable parameter"
            )

    def stepped_by(self, owner: object) -> None:
        """`owner` (a ZeroRedundancyOptimizer) steps these parameters' pieces: its step is a
        collective, which Join must know about (a weak reference: it keeps nothing alive)."""
        self._reducer.sharded_by = weakref.ref(owner)

    def reduce_with(self, reduction: BucketReduction[Any]) -> None:
        """Every bucket goes through `reduction` from now on (stage 2's reduce-scatter)."""
        if isinstance(self._reducer.reduction, CommHookReduction):
            raise ConfigurationError(
                "shard_gradients=True replaces each bucket's all-reduce by a reduce-scatter, "
                "so it cannot be combined with a comm hook — drop register_comm_hook"
            )
        if self._reducer.gradient_as_bucket_view:
            raise ConfigurationError(
                "shard_gradients=True keeps no full-size gradient buckets, which "
                "gradient_as_bucket_view=True asks for — drop gradient_as_bucket_view"
            )
        self._reducer.set_reduction(reduction)
