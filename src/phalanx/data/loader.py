"""`DataLoader`: torch's, counting the batches it hands to the training loop.

With worker processes, torch's DataLoader draws indices from its sampler
ahead of the loop (`prefetch_factor` batches per worker), so the sampler
alone cannot know how far training got. This subclass counts at the
consumer, as torchdata's StatefulDataLoader does, and tells a
`phalanx.DistributedSampler` feeding it: `sampler.state_dict()` is then the
loop's true position whatever `num_workers` and `prefetch_factor` are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from phalanx.data.consumed import ConsumedBatches
from phalanx.data.sampler import DistributedSampler


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader (same arguments) whose iterator counts the batches the loop received."""

    def __iter__(self) -> Any:
        sampler = self._distributed_sampler()
        if sampler is None:
            return super().__iter__()
        consumed = ConsumedBatches(self._samples_per_batch(), self._why_uncountable())
        sampler.attach_consumer(consumed)  # before the first index is drawn
        return _Counted(super().__iter__(), consumed)

    def _distributed_sampler(self) -> DistributedSampler | None:
        for candidate in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(candidate, DistributedSampler):
                return candidate
        return None

    def _samples_per_batch(self) -> int | None:
        if self.batch_sampler is None:
            return 1  # batch_size=None: the loader yields one sample at a time
        size = getattr(self.batch_sampler, "batch_size", None)
        return size if isinstance(size, int) else None

    def _why_uncountable(self) -> str | None:
        if not getattr(self, "in_order", True):
            return "in_order=False hands batches to the loop out of order"
        if self._samples_per_batch() is None:
            return "the batch_sampler has no fixed batch_size"
        return None


class _Counted:
    """The DataLoader's iterator, counting each batch as the loop receives it."""

    def __init__(self, batches: Iterator[Any], consumed: ConsumedBatches) -> None:
        self._batches = batches
        self._consumed = consumed

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self._batches)
        self._consumed.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]
