"""Streaming training sets on two ranks: a `datasets.IterableDataset` of tagged samples is
seen once per pass, disjoint across ranks, and a run stopped mid-pass and resumed ends as
the uninterrupted one (same parameters, same samples on each rank); a plain torch
`IterableDataset` trains, resumes at a pass boundary, and is refused mid-pass in one line;
a pass ends on every rank when one rank runs out; a stream without max_steps is one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset

from phalanx.errors import ConfigurationError
from phalanx.train import Trainer
from tests.distributed.test_trainer_zero import _args
from tests.harness import run_scenarios, run_workers

N = 24
"""Samples in a pass: 12 per rank, 6 steps of 2."""
TOTAL = 15
"""Steps of a run: two passes and half of a third."""


def _row(i: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(i)
    return {"x": torch.randn(6, generator=gen).tolist(), "y": i % 3, "idx": i}


def _collate(rows: list[dict[str, Any]]) -> dict[str, Tensor]:
    return {
        "x": torch.tensor([r["x"] for r in rows]),
        "y": torch.tensor([r["y"] for r in rows]),
        "idx": torch.tensor([r["idx"] for r in rows]),
    }


class _Plain(IterableDataset[dict[str, Any]]):
    """A torch stream with no shards and no state."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (_row(i) for i in range(N))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.net(batch["x"])


def _stream(kind: str) -> Any:
    if kind == "plain":
        return _Plain()
    import datasets

    if kind == "uneven":  # 3 shards over 2 ranks: split by example, 13 and 12 samples
        rows = datasets.Dataset.from_list([_row(i) for i in range(N + 1)])
        return rows.to_iterable_dataset(num_shards=3)
    rows = datasets.Dataset.from_list([_row(i) for i in range(N)])
    return rows.to_iterable_dataset(num_shards=4)


def _train(
    out: Path,
    kind: str,
    max_steps: int,
    resume: bool = False,
    accumulation: int = 1,
    stage: int = 0,
) -> dict[str, Any]:
    """Train to max_steps; the samples trained, as (pass, index) per micro-batch."""
    ledger: list[list[int]] = []
    trainer: Trainer

    def loss_fn(outputs: Tensor, batch: dict[str, Tensor]) -> Tensor:
        ledger.append([trainer.state.epoch, *batch["idx"].tolist()])
        return nn.functional.cross_entropy(outputs, batch["y"])

    args = _args(
        out,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        lr_scheduler_type="constant",  # the same schedule for a run cut short
        save_steps=10_000,
        remove_unused_columns=False,
        gradient_accumulation_steps=accumulation,
        zero_stage=stage,
    )
    trainer = Trainer(
        model=_Net(), args=args, train_dataset=_stream(kind), loss_fn=loss_fn, collate_fn=_collate
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
        params = [_full(p) for p in trainer.model.parameters()]
    finally:
        trainer.close()
    return {"ledger": ledger, "params": params}


def _full(param: Tensor) -> list[float]:
    """A parameter's values, exactly; at stage 3 the whole of it, gathered from its shards."""
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    return full.detach().flatten().tolist()


def _refusal(fn: Any) -> str:
    try:
        fn()
    except ConfigurationError as error:
        return str(error)
    return "not refused"


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    out = Path(root)

    def resumed(
        kind: str, cut: int, total: int = TOTAL, accumulation: int = 1, stage: int = 0
    ) -> dict[str, Any]:
        where = out / f"{kind}-cut{cut}-{accumulation}-{stage}"
        first = _train(where, kind, cut, accumulation=accumulation, stage=stage)
        second = _train(where, kind, total, resume=True, accumulation=accumulation, stage=stage)
        return {"ledger": first["ledger"] + second["ledger"], "params": second["params"]}

    return run_scenarios(
        {
            "hf": lambda: _train(out / "hf", "hf", TOTAL),
            "hf_resumed": lambda: resumed("hf", 9),
            "hf_accumulated": lambda: _train(out / "hf2", "hf", 7, accumulation=2),
            "hf_accumulated_resumed": lambda: resumed("hf", 4, total=7, accumulation=2),
            "hf_stage3": lambda: _train(out / "hf3", "hf", 8, stage=3),
            "hf_stage3_resumed": lambda: resumed("hf", 3, total=8, stage=3),
            "uneven": lambda: _train(out / "uneven", "uneven", 7),
            "plain": lambda: _train(out / "plain", "plain", TOTAL),
            "plain_at_boundary": lambda: resumed("plain", 6),
            "plain_mid_pass": lambda: _refusal(lambda: resumed("plain", 9)),
            "no_max_steps": lambda: _refusal(lambda: _train(out / "none", "plain", -1)),
        },
        rank,
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streams")


@pytest.fixture(scope="module")
def outcomes(root: Path) -> list[dict[str, Any]]:
    return [o.value for o in run_workers(_scenarios, 2, str(root), timeout=240)]


def _at_world_one(rank: int, world: int, where: str) -> str:
    return _refusal(lambda: _train(Path(where), "hf", 20, resume=True))


def _result(outcomes: list[Any], name: str) -> list[Any]:
    got = [outcomes[rank][name] for rank in (0, 1)]
    for value in got:
        assert not (isinstance(value, dict) and "error" in value), value
    return got


def _passes(ledgers: list[list[list[int]]]) -> dict[int, list[list[int]]]:
    """Per pass, each rank's indices trained in it."""
    passes: dict[int, list[list[int]]] = {}
    for rank, ledger in enumerate(ledgers):
        for epoch, *indices in ledger:
            passes.setdefault(epoch, [[], []])[rank].extend(indices)
    return passes


@pytest.mark.parametrize("kind", ["hf", "plain"])
def test_every_sample_once_per_pass_disjoint_across_ranks(outcomes: list[Any], kind: str) -> None:
    if kind == "hf":
        pytest.importorskip("datasets")
    runs = _result(outcomes, kind)
    passes = _passes([run["ledger"] for run in runs])
    assert sorted(passes) == [0, 1, 2]
    for epoch in (0, 1):
        mine, theirs = passes[epoch]
        assert not set(mine) & set(theirs)
        assert sorted(mine + theirs) == list(range(N))
    assert len(passes[2][0]) == len(passes[2][1]) == 3 * 2  # 3 steps of 2 into the third
    if kind == "plain":  # by index: sample i on rank i mod 2
        assert all(i % 2 == 0 for i in passes[0][0])


def test_a_datasets_stream_resumed_mid_pass_ends_as_the_uninterrupted_run(
    outcomes: list[Any],
) -> None:
    pytest.importorskip("datasets")
    whole, resumed = _result(outcomes, "hf"), _result(outcomes, "hf_resumed")
    for rank in (0, 1):
        assert resumed[rank]["ledger"] == whole[rank]["ledger"]
        assert resumed[rank]["params"] == whole[rank]["params"]


def test_a_resume_mid_pass_with_accumulation_is_exact(outcomes: list[Any]) -> None:
    """Steps of two micro-batches: 3 a pass, cut one step into the second pass."""
    pytest.importorskip("datasets")
    whole = _result(outcomes, "hf_accumulated")
    resumed = _result(outcomes, "hf_accumulated_resumed")
    passes = _passes([run["ledger"] for run in whole])
    assert sorted(passes[0][0] + passes[0][1]) == list(range(N))
    for rank in (0, 1):
        assert resumed[rank]["ledger"] == whole[rank]["ledger"]
        assert resumed[rank]["params"] == whole[rank]["params"]


def test_a_resume_mid_pass_at_zero_stage_3_is_exact(outcomes: list[Any]) -> None:
    pytest.importorskip("datasets")
    whole, resumed = _result(outcomes, "hf_stage3"), _result(outcomes, "hf_stage3_resumed")
    for rank in (0, 1):
        assert resumed[rank]["ledger"] == whole[rank]["ledger"]
        assert resumed[rank]["params"] == whole[rank]["params"]
    assert whole[0]["params"] == whole[1]["params"]  # one model, gathered from both ranks


def test_a_pass_ends_on_every_rank_when_one_rank_runs_out(outcomes: list[Any]) -> None:
    """Rank 0's 13th sample would be a seventh step rank 1 has no data for: not trained."""
    pytest.importorskip("datasets")
    passes = _passes([run["ledger"] for run in _result(outcomes, "uneven")])
    assert passes[0] == [list(range(0, N, 2)), list(range(1, N, 2))]  # by example; 24 untrained
    assert passes[1] == [[0, 2], [1, 3]]  # the next pass starts afresh on both ranks


def test_a_plain_stream_resumes_at_a_pass_boundary(outcomes: list[Any]) -> None:
    whole, resumed = _result(outcomes, "plain"), _result(outcomes, "plain_at_boundary")
    for rank in (0, 1):
        assert resumed[rank]["ledger"] == whole[rank]["ledger"]
        assert resumed[rank]["params"] == whole[rank]["params"]


def test_a_plain_stream_mid_pass_resume_is_refused_on_every_rank(outcomes: list[Any]) -> None:
    for message in _result(outcomes, "plain_mid_pass"):
        assert "_Plain) has no state_dict() — a run over it cannot resume mid-pass" in message
        assert "\n" not in message


def test_a_stream_needs_max_steps(outcomes: list[Any]) -> None:
    for message in _result(outcomes, "no_max_steps"):
        assert message.endswith(
            "is a stream with no length, so num_train_epochs cannot say "
            "when training ends — set max_steps > 0"
        )


def test_a_stream_checkpoint_is_refused_at_another_world_size(
    outcomes: list[Any], root: Path
) -> None:
    pytest.importorskip("datasets")
    _result(outcomes, "hf_resumed")  # wrote its checkpoints on two ranks
    where = str(root / "hf-cut9-1-0")
    (message,) = [o.value for o in run_workers(_at_world_one, 1, where, timeout=120)]
    assert message == (
        "the checkpoint's stream was split over 2 ranks and this run has 1, so each rank's "
        "part would be another — resume at world size 2"
    )
