"""`sampler.state_dict()` under a DataLoader with workers: the position the loop consumed.

Worker processes fetch batches ahead of the loop, so counting the indices the
sampler handed out overstates how far training got (20 samples used, 36
drawn), and a resume would skip samples. `phalanx.data.DataLoader` counts at
the consumer; a torch DataLoader with workers makes `state_dict()` refuse to guess.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data
from torch.utils.data import BatchSampler, TensorDataset

from phalanx import ConfigurationError
from phalanx.data import DataLoader, DistributedSampler

N, BATCH = 96, 4
DATA = TensorDataset(torch.arange(N))


def _sampler(epoch: int = 1) -> DistributedSampler:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(epoch)
    return sampler


def _loader(sampler: DistributedSampler, workers: int, cls: Any = DataLoader, **kw: Any) -> Any:
    if workers:
        kw.setdefault("prefetch_factor", 2)
    return cls(DATA, batch_size=BATCH, sampler=sampler, num_workers=workers, **kw)


def _epoch(epoch: int = 1) -> list[int]:
    return list(_sampler(epoch))


def _take(batches: Any, k: int) -> list[int]:
    return [int(i) for _ in range(k) for i in next(batches)[0]]


@pytest.mark.parametrize(("workers", "prefetch"), [(2, 2), (2, 4), (0, None)])
def test_position_is_what_the_loop_consumed_and_resume_continues(
    workers: int, prefetch: int | None
) -> None:
    sampler = _sampler()
    kw = {"prefetch_factor": prefetch} if workers else {}
    batches = iter(_loader(sampler, workers, **kw))
    used = _take(batches, 5)
    state = sampler.state_dict()
    assert state["position"] == 20
    resumed = _sampler()
    resumed.load_state_dict(state)
    rest = [int(i) for (b,) in _loader(resumed, workers) for i in b]
    assert used + rest == _epoch()
    # Counting goes on from the resumed position, not from zero.
    again = _sampler()
    again.load_state_dict(state)
    _take(iter(_loader(again, workers)), 2)
    assert again.state_dict()["position"] == 28


def test_a_torch_loader_with_workers_refuses_to_guess_but_takes_consumed() -> None:
    sampler = _sampler()
    batches = iter(_loader(sampler, 2, cls=torch.utils.data.DataLoader))
    _take(batches, 5)
    with pytest.raises(ConfigurationError, match=r"phalanx\.data\.DataLoader"):
        sampler.state_dict()
    assert sampler.state_dict(consumed=20)["position"] == 20  # the Trainer's way


def test_a_torch_loader_without_workers_still_counts_what_it_drew() -> None:
    sampler = _sampler()
    _take(iter(_loader(sampler, 0, cls=torch.utils.data.DataLoader)), 3)
    assert sampler.state_dict()["position"] == 12


def test_whole_epoch_then_next_epoch() -> None:
    sampler = _sampler()
    loader = _loader(sampler, 2)
    assert len([b for b in loader]) == len(sampler) // BATCH
    assert sampler.state_dict()["position"] == len(sampler)
    sampler.set_epoch(2)
    assert sampler.state_dict()["position"] == 0
    _take(iter(loader), 2)
    assert sampler.state_dict() == {**sampler.state_dict(), "epoch": 2, "position": 8}


def test_drop_last_counts_the_full_batches_only() -> None:
    sampler = DistributedSampler(TensorDataset(torch.arange(22)), num_replicas=1, rank=0)
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler, drop_last=True)  # type: ignore[arg-type]
    assert len(list(loader)) == 5
    assert sampler.state_dict()["position"] == 20


def test_single_samples_count_one_each() -> None:
    sampler = _sampler()
    loader = DataLoader(DATA, batch_size=None, sampler=sampler, num_workers=2)
    samples = iter(loader)
    for _ in range(7):
        next(samples)
    assert sampler.state_dict()["position"] == 7


def test_uncountable_batches_are_refused_with_the_reason() -> None:
    class Pairs(torch.utils.data.Sampler[list[int]]):
        def __init__(self, sampler: DistributedSampler) -> None:
            self.sampler = sampler

        def __iter__(self) -> Any:
            it = iter(self.sampler)
            return iter(lambda: [next(it), next(it)], None)

        def __len__(self) -> int:
            return len(self.sampler) // 2

    sampler = _sampler()
    _take(iter(DataLoader(DATA, batch_sampler=Pairs(sampler))), 2)
    with pytest.raises(ConfigurationError, match="no fixed batch_size"):
        sampler.state_dict()
    ordered = _sampler()
    loader = DataLoader(DATA, batch_sampler=BatchSampler(ordered, 4, False), in_order=False)
    _take(iter(loader), 1)
    with pytest.raises(ConfigurationError, match="in_order=False"):
        ordered.state_dict()
