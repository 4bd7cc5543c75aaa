"""Which reducer's hooks sit on a parameter, read from the hooks themselves.

DDP, ZeRO and PowerSGD ask it of a parameter alone: torch's
`ZeroRedundancyOptimizer(ddp.parameters())` and a comm hook's bucket name no
wrapper. The answer is the reducer's post-accumulate-grad hook on the tensor,
so nothing else is kept: a removed hook answers None at once, and a copied or
pickled parameter carries no hooks, so it answers None too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from phalanx.ddp.reducer import Reducer
from phalanx.ddp.reducer_view import ReducerView

logger = logging.getLogger("phalanx")


def reducer_of(param: torch.Tensor) -> Reducer | None:
    """The reducer whose hooks sit on `param`, if a phalanx DDP wraps it."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    for hook in hooks.values():
        owner = getattr(getattr(hook, "func", None), "__self__", None)
        if isinstance(owner, Reducer):
            return owner
    return None


def detach_earlier_reducers(params: Iterable[torch.Tensor]) -> None:
    """Unhook any earlier wrapper's reducer from these parameters.

    Wrapping a model again (a second Trainer, a new DDP after a change of
    plan) must not leave two reducers hooked on one parameter: both would
    all-reduce every gradient, and the stale one would wait for buckets forever.
    """
    for reducer in _distinct(reducer_of(p) for p in params):
        logger.info("re-wrapping: detaching the earlier DistributedDataParallel from the model")
        reducer.remove_hooks()


def views_of(params: Iterable[torch.Tensor]) -> list[ReducerView]:
    """The reducers hooking any of `params`, each once, as the narrow view ZeRO may use.

    The one lookup for torch's way of building ZeRO, `ZeroRedundancyOptimizer(
    ddp_model.parameters(), ...)`, which names no wrapper: the parameters are all
    it has. Given `ddp_model=`, ZeRO asks nothing here.
    """
    return [ReducerView(r) for r in _distinct(reducer_of(p) for p in params)]


def _distinct(reducers: Iterable[Reducer | None]) -> list[Reducer]:
    found: dict[int, Reducer] = {}
    for reducer in reducers:
        if reducer is not None:
            found.setdefault(id(reducer), reducer)
    return list(found.values())
