"""Callbacks with Hugging Face's events, on two real ranks: what they see, what they ask,
and what happens when one raises.

The ranks must take the same decisions whatever a callback did on one of
them: a save or a stop asked on one rank happens on both at the same step,
and a callback that raises on one rank stops both with one line naming it
(a hang here would fail the test by its deadline). transformers' own
EarlyStoppingCallback runs unchanged, as does phalanx's.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

import pytest
from torch.optim.lr_scheduler import LambdaLR

from phalanx.train import Trainer
from phalanx.train.callbacks import EarlyStoppingCallback, TrainerCallback
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_scenarios, run_workers


class _Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict[str, float]] = []
        self.ranks: set[int] = set()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):

            def record(args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.events.append((name, state.global_step))
                self.ranks.add(state.rank)
                if name == "on_log":
                    self.logs.append(dict(kw["logs"]))
                assert "model" in kw and "optimizer" in kw and "lr_scheduler" in kw

            return record
        return super().__getattribute__(name)


def _trainer(out: Path, callbacks: list[Any], **extra: Any) -> Trainer:
    metrics = extra.pop("compute_metrics", None)
    args = _args(out, **{"max_steps": 6, "logging_steps": 3, "save_steps": 10_000, **extra})
    return Trainer(
        model=_Net(),
        args=args,
        train_dataset=_data(),
        eval_dataset=_data(),
        loss_fn=_xent,
        callbacks=callbacks,
        compute_metrics=metrics,
    )


def _events(rank: int, out: Path) -> dict[str, Any]:
    recorder = _Recorder()
    trainer = _trainer(
        out, [recorder], eval_strategy="steps", eval_steps=2, save_steps=3, adam_beta1=0.8
    )
    assert trainer.optimizer.param_groups[0]["betas"] == (0.8, 0.999)
    trainer.train()
    trainer.close()
    return {"events": recorder.events, "ranks": sorted(recorder.ranks), "logs": recorder.logs}


def _epochs(rank: int, out: Path, save_strategy: str) -> dict[str, Any]:
    recorder = _Recorder()
    trainer = _trainer(
        out,
        [recorder],
        max_steps=-1,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy=save_strategy,
        save_steps=5,
        optim="sgd",
        warmup_ratio=0.25,
        logging_strategy="epoch",
    )
    lrs = [1e-2 * cast(LambdaLR, trainer.scheduler).lr_lambdas[0](k) for k in range(4)]
    trainer.train()
    trainer.close()
    return {
        "evaluated": [s for n, s in recorder.events if n == "on_evaluate"],
        "epoch_ends": [s for n, s in recorder.events if n == "on_epoch_end"],
        "logged": [s for n, s in recorder.events if n == "on_log" and s not in (12, 24)] == []
        and [s for n, s in recorder.events if n == "on_log"].count(12) == 2,
        "saved": sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")),
        "optimizer": type(trainer.optimizer).__name__,
        "lrs": lrs,
    }


class _Asks(TrainerCallback):
    """Rank 0 alone asks for a save at step 2; rank 1 alone asks to stop at step 4."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.rank == 0 and state.global_step == 2:
            control.should_save = True
        if state.rank == 1 and state.global_step == 4:
            control.should_training_stop = True


def _control(rank: int, out: Path) -> dict[str, Any]:
    trainer = _trainer(out, [_Asks()])
    result = trainer.train()
    trainer.close()
    return {"step": result.global_step, "saved": sorted(p.name for p in out.glob("checkpoint-*"))}


class _Scores:
    """An evaluation metric that is best at the first evaluation, then never improves."""

    def __init__(self) -> None:
        self.values = itertools.chain([5.0, 3.0, 4.0], itertools.repeat(1.0))

    def __call__(self, prediction: Any) -> dict[str, float]:
        return {"score": next(self.values)}


def _early(rank: int, out: Path, which: str) -> dict[str, Any]:
    if which == "transformers":
        import transformers

        stopper: Any = transformers.EarlyStoppingCallback(early_stopping_patience=2)
    else:
        stopper = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = _trainer(
        out,
        [stopper],
        max_steps=30,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="score",
        compute_metrics=_Scores(),
    )
    result = trainer.train()
    trainer.close()
    return {"step": result.global_step}


class _Snapshot(TrainerCallback):
    def __init__(self) -> None:
        self.saved: dict[int, list[Any]] = {}

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        params = kw["model"].parameters()
        self.saved[state.global_step] = [p.detach().clone().tolist() for p in params]


def _best(rank: int, out: Path) -> dict[str, Any]:
    snapshot = _Snapshot()
    trainer = _trainer(
        out,
        [snapshot],
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        compute_metrics=_Scores(),
    )
    trainer.train()
    final = [p.detach().tolist() for p in trainer.model.parameters()]
    best = trainer.state.best_model_checkpoint
    trainer.close()
    return {
        "best": Path(best).name if best else None,
        "kept": sorted(p.name for p in out.glob("checkpoint-*")),
        "is_step_2": final == snapshot.saved[2],
        "is_step_8": final == snapshot.saved[8],
    }


class _Raises(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.rank == 1 and state.global_step == 3:
            raise ValueError("the tracker is down")


def _raises(rank: int, out: Path) -> str:
    trainer = _trainer(out, [_Raises()])
    try:
        trainer.train()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        trainer.close()
    return "no error"


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    out = Path(root)
    return run_scenarios(
        {
            "events": lambda: _events(rank, out / "events"),
            "control": lambda: _control(rank, out / "control"),
            "early_phalanx": lambda: _early(rank, out / "early_p", "phalanx"),
            "early_transformers": lambda: _early(rank, out / "early_t", "transformers"),
            "best": lambda: _best(rank, out / "best"),
            "raises": lambda: _raises(rank, out / "raises"),
            "epochs": lambda: _epochs(rank, out / "epochs", "epoch"),
            "epochs_no_save": lambda: _epochs(rank, out / "epochs_no", "no"),
        },
        rank,
    )


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("callbacks")
    return [o.value for o in run_workers(_scenarios, 2, str(root), timeout=240)]


def _ok(outcomes: list[dict[str, Any]], name: str, rank: int) -> Any:
    value = outcomes[rank][name]
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def test_every_rank_sees_hf_events_in_order_with_its_rank(outcomes: list[Any]) -> None:
    for rank in (0, 1):
        got = _ok(outcomes, "events", rank)
        names = [name for name, _ in got["events"]]
        assert names[:4] == ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin"]
        assert names[-1] == "on_train_end"
        steps = [step for name, step in got["events"] if name == "on_step_end"]
        assert steps == [1, 2, 3, 4, 5, 6]
        assert [s for n, s in got["events"] if n == "on_evaluate"] == [2, 4, 6]
        assert [s for n, s in got["events"] if n == "on_save"] == [3, 6]
        assert got["ranks"] == [rank]
        train_logs = [log for log in got["logs"] if "loss" in log]
        assert len(train_logs) == 2 and all("lr" in log for log in train_logs)
        assert len([log for log in got["logs"] if "eval_loss" in log]) == 3
    assert outcomes[0]["events"]["logs"] == outcomes[1]["events"]["logs"]


def test_what_one_rank_asks_happens_on_every_rank(outcomes: list[Any]) -> None:
    for rank in (0, 1):
        assert _ok(outcomes, "control", rank) == {"step": 4, "saved": ["checkpoint-2"]}


@pytest.mark.parametrize("which", ["early_phalanx", "early_transformers"])
def test_early_stopping_stops_every_rank_at_the_same_step(outcomes: list[Any], which: str) -> None:
    if which == "early_transformers":
        pytest.importorskip("transformers")
    # Evaluations at 2 (5.0, best), 4 (3.0), 6 (4.0): two without improvement, patience 2.
    assert [_ok(outcomes, which, r)["step"] for r in (0, 1)] == [6, 6]


def test_the_best_checkpoint_survives_rotation_and_is_loaded_at_the_end(
    outcomes: list[Any],
) -> None:
    for rank in (0, 1):
        got = _ok(outcomes, "best", rank)
        assert got["best"] == "checkpoint-2"
        assert got["kept"] == ["checkpoint-2", "checkpoint-8"]
        assert got["is_step_2"] and not got["is_step_8"]


def test_a_callback_that_raises_on_one_rank_stops_every_rank(outcomes: list[Any]) -> None:
    for rank in (0, 1):
        message = outcomes[rank]["raises"]
        assert message.startswith(
            "CallbackError: a callback failed on rank 1 at step 3: _Raises.on_step_end raised "
            "ValueError: the tracker is down"
        ), message


def test_epoch_strategies_evaluate_and_save_at_each_epoch_end(outcomes: list[Any]) -> None:
    # 96 samples, 2 ranks, micro-batches of 4: 12 steps an epoch.
    for rank in (0, 1):
        got = _ok(outcomes, "epochs", rank)
        assert got["evaluated"] == got["epoch_ends"] == [12, 24]
        assert got["saved"] == [12, 24]
        assert got["logged"], "logging_strategy='epoch' logs (train and eval) at epoch ends only"
        assert got["optimizer"] == "SGD"
        # warmup_ratio 0.25 of 24 steps: 6 warmup steps, learning_rate 1e-2
        assert got["lrs"] == pytest.approx([0.0, 1e-2 / 6, 2e-2 / 6, 3e-2 / 6])
        assert _ok(outcomes, "epochs_no_save", rank)["saved"] == []
