"""How samples become a batch when the Trainer is given no collator: Hugging Face's way.

A tokenised `datasets.Dataset` row is a dict of lists (and strings); torch's
`default_collate` transposes such lists into per-position batches, and the
model then fails deep inside. Hugging Face's Trainer instead drops the
columns the model's forward does not take (`remove_unused_columns`) and
batches the rest with `default_data_collator` (lists become tensors, "label"
becomes "labels", strings are left out). phalanx does the same, with
transformers' own collator when transformers is installed; without it, dict
samples whose values are tensors or numbers are stacked by torch's
`default_collate` and a list value is an error naming the fix. Anything
that is not a dict goes to `default_collate`, as before.

A small class, not a closure: DataLoader workers started with "spawn" must
pickle the collator, and this holds only column names, never the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.utils.data import default_collate

from phalanx.errors import ConfigurationError

_LABEL_COLUMNS = ("label", "label_ids", "labels")


def forward_columns(model: nn.Module) -> frozenset[str] | None:
    """The keyword arguments `model.forward` names (and the label columns HF keeps); None
    when it takes any (**kwargs) or its signature cannot be read."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    named = {n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL}
    return frozenset(named | set(_LABEL_COLUMNS))


class DefaultCollator:
    """Hugging Face's default batching of dict samples (see the module doc)."""

    def __init__(self, columns: frozenset[str] | None) -> None:
        self.columns = columns
        """The columns kept from dict samples; None keeps every one."""

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not samples or not isinstance(samples[0], Mapping):
            return default_collate(list(samples))
        rows = [dict(s) for s in samples]
        if self.columns is not None and any(k in self.columns for k in rows[0]):
            rows = [{k: v for k, v in row.items() if k in self.columns} for row in rows]
        try:
            from transformers import default_data_collator
        except ImportError:
            return _without_transformers(rows)
        return default_data_collator(rows)


def _without_transformers(rows: list[dict[str, Any]]) -> Any:
    listed = next((k for k, v in rows[0].items() if isinstance(v, list)), None)
    if listed is not None:
        raise ConfigurationError(
            f"the samples are dicts whose {listed!r} is a list, which torch cannot batch as "
            "it is — pip install transformers (its default_data_collator is what batches "
            "them), call dataset.set_format('torch'), or pass data_collator="
        )
    return default_collate([{k: v for k, v in r.items() if not isinstance(v, str)} for r in rows])


def one_collator(
    collate_fn: Callable[[list[Any]], Any] | None, data_collator: Callable[[list[Any]], Any] | None
) -> Callable[[list[Any]], Any] | None:
    """collate_fn (phalanx's name) or data_collator (Hugging Face's): one argument."""
    if collate_fn is not None and data_collator is not None:
        raise ConfigurationError(
            "collate_fn and data_collator are one argument (phalanx's name and Hugging "
            "Face's) — pass one of them"
        )
    return collate_fn if collate_fn is not None else data_collator
