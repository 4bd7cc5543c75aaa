"""Find which parameters a forward's outputs can reach in the autograd graph.

With `find_unused_parameters=True` the reducer must know, before backward,
which parameters will get no gradient this iteration: their buckets would
otherwise never fill and every rank would wait forever for the all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def output_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors inside a forward's output: tuples, lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from output_tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from output_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from output_tensors(getattr(obj, f.name))


def reachable_leaves(outputs: Any) -> set[int]:
    """The `id()`s of the leaf tensors whose AccumulateGrad the outputs' graph reaches."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
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
