"""Hugging Face's default batching of dict samples: a tokenised dataset's rows (lists, a
text column, "label") become the model's keyword arguments, with or without transformers."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from phalanx.errors import ConfigurationError
from phalanx.train.collate import DefaultCollator, forward_columns


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(50, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        logits = self.head(self.embed(input_ids))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"input_ids": [i, i + 1, i + 2], "label": i % 2, "text": f"row {i}"} for i in range(n)]


def test_dict_rows_are_batched_as_hugging_face_batches_them() -> None:
    pytest.importorskip("transformers")
    batch = DefaultCollator(forward_columns(_Classifier()))(_rows(4))
    assert sorted(batch) == ["input_ids", "labels"]  # text dropped, label renamed
    assert batch["input_ids"].shape == (4, 3) and batch["labels"].tolist() == [0, 1, 0, 1]
    assert torch.isfinite(_Classifier()(**batch)["loss"])


def test_without_transformers_tensors_batch_and_lists_name_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    collate = DefaultCollator(None)
    rows = [{"x": torch.ones(2) * i, "y": i, "text": "t"} for i in range(3)]
    batch = collate(rows)
    assert batch["x"].shape == (3, 2) and batch["y"].tolist() == [0, 1, 2] and "text" not in batch
    with pytest.raises(
        ConfigurationError, match=r"'input_ids' is a list.*pip install transformers"
    ):
        collate(_rows(2))


def test_samples_that_are_not_dicts_go_to_torchs_default_collate() -> None:
    batch = DefaultCollator(frozenset({"x"}))([(torch.zeros(2), 1), (torch.ones(2), 0)])
    assert batch[0].shape == (2, 2) and batch[1].tolist() == [1, 0]


def test_a_forward_taking_anything_keeps_every_column() -> None:
    class Open(nn.Module):
        def forward(self, **kwargs: Any) -> Any:
            return kwargs

    assert forward_columns(Open()) is None
    assert forward_columns(_Classifier()) == {"input_ids", "labels", "label", "label_ids"}
