"""The one tensor walker keeps every container as it was given."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from phalanx.runtime.nested import iter_tensors, map_tensors

Pair = namedtuple("Pair", ["x", "y"])


@dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    note: str = "kept"
    hidden: torch.Tensor = field(init=False, default_factory=lambda: torch.zeros(1))


def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_namedtuple_stays_that_namedtuple() -> None:
    out = map_tensors(double, Pair(torch.ones(2), [torch.ones(1), "s"]))
    assert type(out) is Pair
    assert out.x.tolist() == [2.0, 2.0] and out.y[0].tolist() == [2.0] and out.y[1] == "s"


def test_frozen_dataclass_keeps_type_and_init_false_fields() -> None:
    out = map_tensors(double, Frozen(torch.ones(1)))
    assert type(out) is Frozen and out.note == "kept"
    assert out.a.tolist() == [2.0] and out.hidden.tolist() == [0.0]


def test_mappings_keep_their_types_and_extras() -> None:
    ordered = map_tensors(double, OrderedDict(b=torch.ones(1), a=torch.ones(1)))
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"]
    counts: defaultdict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(1))
    counts["k"] = torch.ones(1)
    out = map_tensors(double, counts)
    assert type(out) is defaultdict and out["k"].tolist() == [2.0]
    assert out["missing"].tolist() == [0.0]  # default_factory kept
    frozen = map_tensors(double, MappingProxyType({"k": torch.ones(1)}))
    assert frozen == {"k": torch.full((1,), 2.0)}


def test_tuple_list_and_leaves() -> None:
    out = map_tensors(double, (torch.ones(1), [torch.ones(1)], 3, None))
    assert type(out) is tuple and type(out[1]) is list and out[2:] == (3, None)


def test_iter_tensors_finds_every_tensor_in_order() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    nested = {"p": Pair(a, [b]), "f": Frozen(c), "t": (d,)}
    found = [float(t) for t in iter_tensors(nested)]
    assert found == [0.0, 1.0, 2.0, 0.0, 3.0]  # Frozen.hidden (zeros) after Frozen.a
