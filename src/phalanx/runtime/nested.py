"""One walker for the tensors inside nested Python values: batches and forward outputs.

Moving a batch to a device, finding the tensors a forward returned (for the
unused-parameter search) and measuring a batch all look through the same
containers: tuples, lists, mappings, namedtuples and dataclasses. A move must
hand back the same kind of container it was given (a namedtuple stays that
namedtuple, a dataclass the same dataclass, an OrderedDict an OrderedDict),
because user code reads fields by name.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside `obj`, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from iter_tensors(value)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """`obj` with `fn` applied to every tensor inside it; containers keep their types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _map_mapping(fn, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, list | tuple):
        items = [map_tensors(fn, v) for v in obj]
        return items if type(obj) is list else type(obj)(items)
    if _is_dataclass_instance(obj):
        # A shallow copy then field by field: works for frozen, slotted and
        # init=False fields alike, which dataclasses.replace does not.
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    return obj


def _map_mapping(fn: Callable[[torch.Tensor], torch.Tensor], obj: Mapping[Any, Any]) -> Any:
    mapped = {key: map_tensors(fn, value) for key, value in obj.items()}
    if type(obj) is dict:
        return mapped
    try:
        # OrderedDict, defaultdict, Hugging Face's ModelOutput and BatchEncoding:
        # a copy keeps the type and its extras (default_factory, attributes).
        new = copy.copy(obj)
        for key, value in mapped.items():
            new[key] = value  # type: ignore[index]
        return new
    except TypeError:  # a read-only mapping (MappingProxyType): a plain dict will do
        return mapped


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)
