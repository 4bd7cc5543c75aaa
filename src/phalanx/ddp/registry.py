"""Which reducer's hooks sit on a parameter: the side table DDP, ZeRO and PowerSGD read.

Hooks are process-wide state attached to the tensor itself, so this table is
too; weak both ways, it keeps nothing alive and, unlike an attribute on the
parameter, never travels with a pickled model. Keyed by id(): tensors compare
elementwise, so they cannot be dictionary keys.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable

import torch

from phalanx.ddp.reducer import Reducer
from phalanx.ddp.reducer_view import ReducerView

logger = logging.getLogger("phalanx")

_REDUCER_OF: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Reducer]]] = {}


def reducer_of(param: torch.Tensor) -> Reducer | None:
    """The live reducer whose hooks sit on `param`, if a phalanx DDP wraps it."""
    entry = _REDUCER_OF.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def register(params: Iterable[torch.Tensor], reducer: Reducer) -> None:
    """`reducer` now hooks these parameters."""
    for p in params:
        _REDUCER_OF[id(p)] = (weakref.ref(p), weakref.ref(reducer))


def forget(params: Iterable[torch.Tensor], reducer: Reducer) -> None:
    """`reducer` was unhooked from these parameters."""
    for p in params:
        if reducer_of(p) is reducer:
            del _REDUCER_OF[id(p)]


def detach_earlier_reducers(params: Iterable[torch.Tensor]) -> None:
    """Unhook any earlier wrapper's reducer from these parameters.

    Wrapping a model again (a second Trainer, a new DDP after a change of
    plan) must not leave two reducers hooked on one parameter: both would
    all-reduce every gradient, and the stale one would wait for buckets forever.
    """
    for key, (param_ref, reducer_ref) in list(_REDUCER_OF.items()):
        if param_ref() is None or reducer_ref() is None:
            del _REDUCER_OF[key]  # prune: that parameter or reducer is gone
    earlier: dict[int, Reducer] = {}
    for p in params:
        reducer = reducer_of(p)
        if reducer is not None:
            earlier[id(reducer)] = reducer
    for reducer in earlier.values():
        logger.info("re-wrapping: detaching the earlier DistributedDataParallel from the model")
        reducer.remove_hooks()


def views_of(params: Iterable[torch.Tensor]) -> list[ReducerView]:
    """The reducers hooking any of `params`, each once, as the narrow view ZeRO may use.

    The one lookup for torch's way of building ZeRO, `ZeroRedundancyOptimizer(
    ddp_model.parameters(), ...)`, which names no wrapper: the parameters are all
    it has. Given `ddp_model=`, ZeRO asks nothing here.
    """
    views: dict[int, ReducerView] = {}
    for p in params:
        reducer = reducer_of(p)
        if reducer is not None:
            views.setdefault(id(reducer), ReducerView(reducer))
    return list(views.values())
