"""A tokenised dataset's raw rows (dicts of lists, a text column, "label"), trained by the
Trainer with no collator at stages 0 and 3 on two ranks; and torch_compile, whose compiled
run (backend "eager": the graph alone) trains bit for bit as the plain one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.train import Trainer, TrainingArguments
from tests.checkpoints import record_losses
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_scenarios, run_workers
from tests.unit.test_collate import _Classifier, _rows
from tests.unit.test_hf_arguments_port import COMMON

pytest.importorskip("transformers", reason="its default_data_collator batches dict rows")


def _tokenised(rows: list[dict[str, Any]], hf_dataset: bool) -> Any:
    """The rows as they are, or as a `datasets.Dataset` (no set_format: plain lists)."""
    if not hf_dataset:
        return rows
    import datasets

    return datasets.Dataset.from_list(rows)


def _raw_rows(rank: int, out: Path, stage: int, hf_dataset: bool = False) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    args = _args(out, zero_stage=stage, max_steps=4, logging_steps=1, save_steps=10_000)
    data = _tokenised(_rows(40), hf_dataset)
    trainer = Trainer(model=_Classifier(), args=args, train_dataset=data)
    result = trainer.train()
    trainer.close()
    return {"steps": result.global_step, "loss": result.train_loss}


def _compiled(rank: int, out: Path, compile_: bool) -> list[float]:
    args = _args(
        out,
        max_steps=5,
        logging_steps=1,
        save_steps=10_000,
        torch_compile=compile_,
        torch_compile_backend="eager",
    )
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    losses = record_losses(trainer)
    trainer.train()
    params = [float(p.detach().sum()) for p in trainer.model.parameters()]
    was_compiled = getattr(trainer.model, "_compiled_call_impl", None) is not None
    trainer.close()
    return [*losses, *params, float(was_compiled)]


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    out = Path(root)
    return run_scenarios(
        {
            "rows0": lambda: _raw_rows(rank, out / "rows0", 0),
            "rows3": lambda: _raw_rows(rank, out / "rows3", 3),
            "datasets0": lambda: _raw_rows(rank, out / "ds0", 0, hf_dataset=True),
            "datasets3": lambda: _raw_rows(rank, out / "ds3", 3, hf_dataset=True),
            "plain": lambda: _compiled(rank, out / "plain", False),
            "compiled": lambda: _compiled(rank, out / "compiled", True),
        },
        rank,
    )


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hf_data")
    return [o.value for o in run_workers(_scenarios, 2, str(root), timeout=240)]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kind", ["rows", "datasets"])
def test_raw_tokenised_rows_train_with_no_collator(
    outcomes: list[Any], stage: int, kind: str
) -> None:
    if kind == "datasets":
        pytest.importorskip("datasets")
    for rank in (0, 1):
        got = outcomes[rank][f"{kind}{stage}"]
        assert "error" not in got, got
        assert got["steps"] == 4 and got["loss"] == got["loss"]  # trained, not NaN


def test_a_compiled_model_trains_as_the_plain_one(outcomes: list[Any]) -> None:
    for rank in (0, 1):
        plain, compiled = outcomes[rank]["plain"], outcomes[rank]["compiled"]
        assert not isinstance(compiled, dict), compiled
        assert (compiled[-1], plain[-1]) == (1.0, 0.0), "the compiled run was not compiled"
        assert compiled[:-1] == plain[:-1]


def test_torch_compile_is_refused_at_stage_3() -> None:
    from phalanx.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="torch_compile with zero_stage=3"):
        TrainingArguments(torch_compile=True, zero_stage=3)


def test_the_ported_call_runs(tmp_path: Path) -> None:
    """The same arguments drive a real (one-process) run: evaluations every logging_steps,
    the best checkpoint kept through save_total_limit and loaded at the end."""
    from torch import nn
    from torch.utils.data import TensorDataset

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 2)

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            return self.body(batch[0])

    args = TrainingArguments(**{**COMMON, "output_dir": str(tmp_path), "max_steps": 40})
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = Trainer(
        model=Net(),
        args=args,
        train_dataset=data,
        eval_dataset=data,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
    )
    result = trainer.train()
    best = trainer.state.best_model_checkpoint
    trainer.close()
    assert result.global_step == 40 and best is not None
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert Path(best).name in kept and len(kept) <= 3  # save_total_limit 2, and the best
