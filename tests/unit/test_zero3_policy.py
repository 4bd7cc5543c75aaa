"""Which modules the default stage 3 policy makes units, and the class-name policy."""

from __future__ import annotations

import pytest
from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.zero3 import by_class_names, repeated_blocks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.stem = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # mixed classes: not blocks
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(2))  # lighter than the blocks


def test_the_heaviest_list_of_one_class_is_chosen() -> None:
    model = Model()
    assert repeated_blocks(model) == list(model.blocks)


def test_a_model_without_repeated_blocks_gets_no_unit_but_the_root() -> None:
    assert repeated_blocks(nn.Linear(3, 3)) == []


def test_class_names_pick_the_outermost_match_and_a_miss_is_explained() -> None:
    model = Model()
    assert by_class_names(["Block", "Linear"])(model) == [
        model.stem[0],
        *model.blocks,
        *model.heads,
    ]
    with pytest.raises(ConfigurationError, match="no module of class"):
        by_class_names(["DecoderLayer"])(model)
