"""`DistributedSampler.reshard` (live recovery): the rest of an epoch dealt over a new world,
nothing skipped, nothing dealt twice, and a saved state resumed exactly after it."""

from __future__ import annotations

import itertools

import pytest

from phalanx.data import DistributedSampler


def _take(samplers: list[DistributedSampler], per_rank: int) -> list[list[int]]:
    """`per_rank` indices from each rank's next iteration (each sampler's own pass)."""
    return [list(itertools.islice(iter(s), per_rank)) for s in samplers]


def _epoch_order(n: int, seed: int = 0) -> list[int]:
    return list(iter(DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed)))


@pytest.mark.parametrize(("n", "worlds"), [(120, [3, 2, 3]), (101, [3, 2]), (64, [4, 1, 3])])
def test_the_rest_of_the_epoch_is_dealt_once(n: int, worlds: list[int]) -> None:
    seen: list[int] = []
    used = 0
    for stage, world in enumerate(worlds):
        samplers = [
            DistributedSampler(range(n), num_replicas=worlds[0], rank=r) for r in range(world)
        ]
        for r, s in enumerate(samplers):
            s.reshard(world, r, used)
        last = stage == len(worlds) - 1
        per_rank = len(samplers[0]) if last else 5
        assert {len(s) for s in samplers} == {len(samplers[0])}  # an equal count per rank
        taken = _take(samplers, per_rank)
        for i in range(per_rank):  # positions used + i*world + r, rank by rank
            seen.extend(taken[r][i] for r in range(world))
        used += per_rank * world
    order = _epoch_order(n)
    assert seen[:n] == order  # every sample once, in the epoch's order
    assert seen[n:] == order[: len(seen) - n]  # then torch's padding: the order's start again


def test_a_state_saved_after_a_reshard_resumes_exactly() -> None:
    sampler = DistributedSampler(range(90), num_replicas=3, rank=1)
    sampler.reshard(2, 1, 30)
    state = sampler.state_dict(consumed=4)
    rest = list(iter(sampler))[4:]
    again = DistributedSampler(range(90), num_replicas=2, rank=1)
    again.load_state_dict(state)
    assert list(iter(again)) == rest
    assert state["base"] == 30


def test_a_new_epoch_starts_from_the_beginning_over_the_new_world() -> None:
    sampler = DistributedSampler(range(60), num_replicas=3, rank=0)
    sampler.reshard(2, 0, 30)
    sampler.set_epoch(1)
    full = DistributedSampler(range(60), num_replicas=2, rank=0)
    full.set_epoch(1)
    assert list(iter(sampler)) == list(iter(full))


def test_a_snapshot_at_a_padded_epochs_end_is_taken_back_after_the_next_epoch_began() -> None:
    """The stage-3 goodput run's third loss: 464 of 480 used at 2 ranks, the rest dealt
    over 3 (16 -> 18 with padding), the epoch finished (482 positions), a snapshot taken
    there; then the next epoch began and a loss rolled back to that snapshot. Its
    position is the whole epoch, and what is left of it is nothing (it was 482, refused)."""
    samplers = [DistributedSampler(range(480), num_replicas=3, rank=r) for r in range(3)]
    for r, s in enumerate(samplers):
        s.set_epoch(1)
        s.reshard(3, r, 464)
    assert {len(s) for s in samplers} == {6}  # 16 left, padded to 18
    used = samplers[0].used_by_all(6)
    assert used == 480 and samplers[0].used_by_all(4) == 476
    survivor = samplers[0]
    survivor.set_epoch(2)  # the next epoch began, then the loss: back to the snapshot
    survivor.set_epoch(1)
    survivor.reshard(2, 0, used)
    assert len(survivor) == 0 and list(iter(survivor)) == []
    with pytest.raises(Exception, match="used_by_all=481 is outside this epoch's 480 indices"):
        survivor.reshard(2, 0, 481)
