"""A plain stream's part for each rank (by index, set_epoch passed on) and the arguments a
stream refuses, each in one line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import IterableDataset

from phalanx.errors import ConfigurationError
from phalanx.train import TrainingArguments
from phalanx.train.streams import EveryNth, check_stream_arguments, is_hf_stream, is_stream


class _Counting(IterableDataset[int]):
    def __init__(self) -> None:
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(100 * self.epoch, 100 * self.epoch + 7))


def test_a_plain_stream_is_split_by_index_and_gets_its_epoch() -> None:
    data = _Counting()
    parts = [EveryNth(data, rank, 3) for rank in range(3)]
    parts[0].set_epoch(2)
    assert [list(part) for part in parts] == [[200, 203, 206], [201, 204], [202, 205]]
    assert is_stream(data) and not is_hf_stream(data) and not is_stream([1, 2])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"^the train_dataset \(_Counting\) is a stream .* — set max_steps > 0$"),
        (
            {"max_steps": 5, "dataloader_num_workers": 2},
            r"^dataloader_num_workers=2 with a streaming .* — set dataloader_num_workers=0$",
        ),
    ],
)
def test_what_a_stream_refuses(fields: dict[str, Any], message: str) -> None:
    args = TrainingArguments(output_dir="unused", report_to=[], **fields)
    with pytest.raises(ConfigurationError, match=message):
        check_stream_arguments(_Counting(), args)
    check_stream_arguments(_Counting(), TrainingArguments(output_dir="unused", max_steps=5))


def test_a_datasets_stream_is_told_apart() -> None:
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_list([{"a": 1}]).to_iterable_dataset()
    assert is_stream(stream) and is_hf_stream(stream)
    stream.__class__ = type("MyStream", (datasets.IterableDataset,), {})  # a user's subclass
    assert is_hf_stream(stream)


def test_a_datasets_stream_split_already_is_refused() -> None:
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    whole = datasets.Dataset.from_list([{"a": i} for i in range(8)]).to_iterable_dataset()
    part = split_dataset_by_node(whole, rank=0, world_size=2)
    args = TrainingArguments(output_dir="unused", report_to=[], max_steps=5)
    with pytest.raises(ConfigurationError, match=r"already this rank's part .* splits it by rank$"):
        check_stream_arguments(part, args)
    check_stream_arguments(whole, args)
