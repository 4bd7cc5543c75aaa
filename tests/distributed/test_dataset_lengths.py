"""Ranks given datasets of different lengths are refused in one line (issue 36, item 8).

The sampler deals one dataset out by index from len(dataset) alone. With 96 samples on
rank 0 and 92 on rank 1 the Trainer trained on, reading some samples twice and others
never, without a word; with 96 against 80 the ranks counted different numbers of steps
and rank 0 waited in a collective for the whole ddp_timeout. Now the Trainer compares
the lengths when it starts (and evaluate() when it evaluates) with one tensor
all-gather, and `phalanx.data.check_same_length` does the same for a hand-written loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import TensorDataset

from phalanx.data import DistributedSampler, check_same_length
from phalanx.train import Trainer
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers


def _sized(n: int) -> TensorDataset:
    full = _data()
    return TensorDataset(*(t[:n] for t in full.tensors))


def _train(rank: int, world: int, out: str, lengths: list[int]) -> str:
    args = _args(Path(out), max_steps=4, save_steps=10_000, ddp_timeout=60)
    trainer = Trainer(model=_Net(), args=args, train_dataset=_sized(lengths[rank]), loss_fn=_xent)
    trainer.train()
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lengths", [[96, 92], [96, 80]], ids=["96-92", "96-80"])
def test_the_trainer_refuses_training_sets_of_different_lengths(
    tmp_path: Path, lengths: list[int]
) -> None:
    outcomes = run_workers(
        _train, 2, str(tmp_path), lengths, init_pg=False, allow_errors=True, timeout=90
    )
    for o in outcomes:
        assert o.error_type == "ConfigurationError", (o.rank, o.error_type, o.error)
        message = (o.error or "").strip()
        expected = "the ranks' training sets differ in length (rank 0: 96 samples; rank 1: "
        assert message.startswith(expected + f"{lengths[1]})"), message
        assert "\n" not in message


def _evaluate(rank: int, world: int, out: str) -> dict[str, float]:
    args = _args(Path(out), max_steps=1, save_steps=10_000)
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    return trainer.evaluate(_sized(48 if rank == 0 else 40))


@pytest.mark.timeout(120)
def test_evaluate_refuses_evaluation_sets_of_different_lengths(tmp_path: Path) -> None:
    outcomes = run_workers(
        _evaluate, 2, str(tmp_path), init_pg=False, allow_errors=True, timeout=90
    )
    for o in outcomes:
        assert o.error_type == "ConfigurationError", (o.rank, o.error_type, o.error)
        assert "the ranks' evaluation sets differ in length (rank 0: 48 samples; rank 1: 40)" in (
            o.error or ""
        )


def _hand_loop(rank: int, world: int) -> tuple[int, list[int], str | None]:
    """A hand-written loop: the sampler alone deals from its own rank's length, unasked;
    check_same_length is the loop's own check."""
    same = check_same_length(_sized(96))
    sampler = DistributedSampler(_sized(96 if rank == 0 else 92), shuffle=True, seed=0)
    dealt = list(sampler)
    try:
        check_same_length(_sized(96 if rank == 0 else 92), what="training set")
    except Exception as exc:
        return same, dealt, f"{type(exc).__name__}: {exc}"
    return same, dealt, None


@pytest.mark.timeout(120)
def test_a_hand_written_loop_checks_with_check_same_length() -> None:
    outcomes = run_workers(_hand_loop, 2, timeout=90)
    (same0, dealt0, error0), (same1, dealt1, error1) = (o.value for o in outcomes)
    assert same0 == same1 == 96
    # What the sampler alone does, unasked: each rank deals from its own length, so the
    # shards overlap and miss samples (why the check exists; docs/data.md).
    assert len(dealt0) == 48 and len(dealt1) == 46
    assert set(dealt0) & set(dealt1) and len(set(dealt0) | set(dealt1)) < 96
    for error in (error0, error1):
        assert error == (
            "ConfigurationError: the ranks' training sets differ in length (rank 0: 96 "
            "samples; rank 1: 92) — give every rank the same training set: the sampler deals "
            "one dataset out by index, so different lengths would repeat some samples and "
            "skip others, or leave the ranks with different numbers of steps"
        )
