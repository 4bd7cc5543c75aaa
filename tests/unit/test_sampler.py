"""DistributedSampler: torch's index sequences, exact-once evaluation, mid-epoch resume."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

from phalanx import ConfigurationError
from phalanx.data import DistributedSampler

SMALL_SIZES = range(51)
LARGE_SIZES = (997, 4096, 100_003)
WORLDS = range(1, 6)


def _ours(n: int, world: int, rank: int, **kw: Any) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=world, rank=rank, **kw)


def _theirs(n: int, world: int, rank: int, **kw: object) -> TorchSampler[int]:
    return TorchSampler(range(n), num_replicas=world, rank=rank, **kw)  # type: ignore[arg-type]


def _pairs(sizes: object) -> list[tuple[int, int, int, bool, bool]]:
    grid = itertools.product(sizes, WORLDS, (False, True), (False, True))  # type: ignore[call-overload]
    return [
        (n, world, rank, shuffle, drop)
        for n, world, shuffle, drop in grid
        for rank in range(world)
        if not (drop and n < world)  # that case is a configuration error here, tested below
    ]


@pytest.mark.parametrize("seed,epoch", [(0, 0), (0, 3), (1234, 1)])
def test_matches_torch_index_for_index_on_small_sizes(seed: int, epoch: int) -> None:
    for n, world, rank, shuffle, drop in _pairs(SMALL_SIZES):
        kw = {"shuffle": shuffle, "seed": seed, "drop_last": drop}
        ours, theirs = _ours(n, world, rank, **kw), _theirs(n, world, rank, **kw)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        case = (n, world, rank, shuffle, drop)
        assert list(ours) == list(theirs), case
        assert len(ours) == len(theirs), case


@pytest.mark.parametrize("n", LARGE_SIZES)
def test_matches_torch_on_large_sizes(n: int) -> None:
    for world, drop in itertools.product((2, 3, 5), (False, True)):
        rank = world - 1
        ours, theirs = (
            _ours(n, world, rank, seed=9, drop_last=drop),
            _theirs(n, world, rank, seed=9, drop_last=drop),
        )
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs), (n, world, drop)


def test_epochs_and_seeds_change_the_order() -> None:
    sampler = _ours(40, 2, 0, seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(_ours(40, 2, 0, seed=6)) != first


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_the_dataset(shuffle: bool) -> None:
    for n, world in itertools.product(SMALL_SIZES, WORLDS):
        shards = [list(_ours(n, world, r, shuffle=shuffle, seed=3)) for r in range(world)]
        everything = [i for shard in shards for i in shard]
        assert set(everything) == set(range(n)), (n, world)
        # padding repeats exactly as many samples as needed to even out the ranks
        assert len(everything) - n == (-n) % world, (n, world)
        assert len({len(s) for s in shards}) <= 1


def test_drop_last_shards_are_disjoint_and_equal() -> None:
    for n, world in itertools.product(SMALL_SIZES, WORLDS):
        if n < world:
            continue
        shards = [list(_ours(n, world, r, drop_last=True)) for r in range(world)]
        everything = [i for shard in shards for i in shard]
        assert len(everything) == len(set(everything)) == n - n % world
        assert len({len(s) for s in shards}) == 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_false_sees_every_sample_exactly_once(shuffle: bool) -> None:
    for n, world in itertools.product(SMALL_SIZES, WORLDS):
        samplers = [_ours(n, world, r, shuffle=shuffle, pad=False) for r in range(world)]
        shards = [list(s) for s in samplers]
        assert sorted(i for shard in shards for i in shard) == list(range(n)), (n, world)
        assert [len(s) for s in samplers] == [len(shard) for shard in shards]
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_pad_false_is_torchs_shard_without_its_padding() -> None:
    for n, world in itertools.product(SMALL_SIZES, WORLDS):
        for rank in range(world):
            ours = list(_ours(n, world, rank, seed=2, pad=False))
            padded = list(_theirs(n, world, rank, seed=2))
            assert padded[: len(ours)] == ours


def test_drop_last_leaving_a_rank_empty_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="drop_last=True leaves rank 2"):
        _ours(3, 4, 2, drop_last=True)
    with pytest.raises(ConfigurationError, match="drop_last=False"):
        _ours(0, 2, 0, drop_last=True)


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0)])
def test_bad_rank_or_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ConfigurationError):
        _ours(10, world, rank)


def test_world_and_rank_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(range(9))
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == list(_theirs(9, 3, 2))
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ConfigurationError, match="RANK='two'"):
        DistributedSampler(range(9))


def test_without_launcher_it_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    sampler = DistributedSampler(range(7), shuffle=False)
    assert list(sampler) == list(range(7))


def _take(sampler: DistributedSampler, k: int) -> list[int]:
    return list(itertools.islice(iter(sampler), k))


@pytest.mark.parametrize("n,world,drop", [(23, 3, False), (23, 3, True), (8, 1, False)])
def test_resume_mid_epoch_continues_the_uninterrupted_sequence(
    n: int, world: int, drop: bool
) -> None:
    for rank in range(world):
        reference = _ours(n, world, rank, seed=4, drop_last=drop)
        reference.set_epoch(1)
        epoch1 = list(reference)
        reference.set_epoch(2)
        epoch2 = list(reference)
        for cut in range(len(epoch1) + 1):
            before = _ours(n, world, rank, seed=4, drop_last=drop)
            before.set_epoch(1)
            seen = _take(before, cut)
            state = before.state_dict()
            assert state["position"] == cut
            after = _ours(n, world, rank, seed=4, drop_last=drop)
            after.load_state_dict(state)
            after.set_epoch(1)  # a resuming loop sets the loaded epoch again: must keep the place
            assert seen + list(after) == epoch1, (rank, cut)
            after.set_epoch(2)
            assert list(after) == epoch2


def test_after_the_resumed_epoch_a_new_pass_starts_from_zero() -> None:
    before = _ours(20, 2, 1)
    _take(before, 4)
    after = _ours(20, 2, 1)
    after.load_state_dict(before.state_dict())
    assert len(list(after)) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(after) == list(_ours(20, 2, 1))


def test_consumed_overrides_what_the_iterator_handed_out() -> None:
    sampler = _ours(30, 2, 0, seed=1)
    full = list(sampler)  # as if a prefetching DataLoader drained the epoch
    state = sampler.state_dict(consumed=6)
    assert state["position"] == 6
    resumed = _ours(30, 2, 0, seed=1)
    resumed.load_state_dict(state)
    assert list(resumed) == full[6:]
    with pytest.raises(ConfigurationError, match="consumed=16"):
        sampler.state_dict(consumed=16)


def test_state_position_counts_batches_of_a_dataloader_without_workers() -> None:
    data = TensorDataset(torch.arange(50))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, seed=8)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    batches = iter(loader)
    got = [next(batches)[0] for _ in range(3)]
    state = sampler.state_dict()
    assert state["position"] == 12
    resumed = DistributedSampler(data, num_replicas=2, rank=0, seed=8)
    resumed.load_state_dict(state)
    rest = [b[0] for b in DataLoader(data, batch_size=4, sampler=resumed)]
    assert torch.cat(got + rest).tolist() == list(_theirs(50, 2, 0, seed=8))


def test_state_survives_a_weights_only_round_trip(tmp_path: object) -> None:
    sampler = _ours(17, 2, 0)
    _take(sampler, 3)
    path = f"{tmp_path}/sampler.pt"
    torch.save(sampler.state_dict(), path)
    resumed = _ours(17, 2, 0)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert list(resumed) == list(_ours(17, 2, 0))[3:]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"world": 3}, "saved with 2 ranks but this run has 3"),
        ({"n": 21}, "dataset of 20 samples"),
        ({"seed": 1}, "seed=0"),
        ({"drop_last": True}, "drop_last=False"),
    ],
)
def test_resuming_a_different_setup_is_refused(change: dict[str, int], match: str) -> None:
    state = _ours(20, 2, 0).state_dict()
    kw = {"seed": change.get("seed", 0), "drop_last": bool(change.get("drop_last", False))}
    other = _ours(change.get("n", 20), change.get("world", 2), 0, **kw)
    with pytest.raises(ConfigurationError, match=match):
        other.load_state_dict(state)


def test_forgotten_set_epoch_warns_once() -> None:
    sampler = _ours(10, 2, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            list(sampler)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "sampler.set_epoch(epoch)" in messages[0]


def test_no_warning_when_set_epoch_is_called_or_order_is_fixed() -> None:
    shuffled, fixed = _ours(10, 2, 0), _ours(10, 2, 0, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(3):
            shuffled.set_epoch(epoch)
            list(shuffled)
            list(fixed)


def test_dataset_without_length_is_refused() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            yield 0

    with pytest.raises(ConfigurationError, match="Stream has no __len__"):
        DistributedSampler(Stream(), num_replicas=1, rank=0)
