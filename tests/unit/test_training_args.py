"""TrainingArguments: every field's validation, and loading from the CLI, JSON and YAML.

Also the checks that need the model or the device (fp16 on CPU, gradient
checkpointing), made by a Trainer in one plain process: a one-rank group, no DDP.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from phalanx.ddp.options import DDPOptions
from phalanx.errors import ConfigurationError
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.batches import takes_keyword_batch
from phalanx.train.config.argsio import field_docs
from phalanx.train.schedules import lr_factor

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def test_the_defaults_are_valid_and_round_trip_through_to_dict() -> None:
    args = TrainingArguments()
    assert TrainingArguments(**args.to_dict()) == args
    assert json.loads(json.dumps(args.to_dict())) == args.to_dict()
    assert args.report_to == ["console", "jsonl"]
    assert TrainingArguments().report_to is not args.report_to  # no shared mutable default


def test_every_field_has_a_docstring() -> None:
    docs = field_docs(TrainingArguments)
    assert set(docs) == set(TrainingArguments().to_dict())
    assert all(len(text) > 15 for text in docs.values())


BAD_VALUES: list[tuple[str, Any, str]] = [
    ("output_dir", "  ", "output_dir is empty"),
    ("seed", -1, "seed=-1"),
    ("seed", 2**32, "NumPy"),
    ("num_train_epochs", 0.0, "num_train_epochs=0.0 must be > 0"),
    ("num_train_epochs", math.inf, "num_train_epochs=inf"),
    ("max_steps", 0, "max_steps=0 trains nothing"),
    ("max_steps", -5, "max_steps=-5"),
    ("per_device_train_batch_size", 0, "per_device_train_batch_size=0 must be >= 1"),
    ("per_device_eval_batch_size", -1, "per_device_eval_batch_size=-1"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0"),
    ("dataloader_num_workers", -1, "dataloader_num_workers=-1"),
    ("learning_rate", -1e-3, "learning_rate=-0.001"),
    ("learning_rate", math.nan, "learning_rate=nan"),
    ("weight_decay", -0.1, "weight_decay=-0.1"),
    ("lr_scheduler_type", "step", "lr_scheduler_type='step' is unknown"),
    ("warmup_steps", -1, "warmup_steps=-1"),
    ("max_grad_norm", -1.0, "max_grad_norm=-1.0"),
    ("logging_steps", 0, "logging_steps=0"),
    ("eval_steps", -1, "eval_steps=-1"),
    ("save_steps", -1, "save_steps=-1"),
    ("save_total_limit", 0, "would delete every checkpoint"),
    ("report_to", ["console", "comet_ml"], "report_to names ['comet_ml']"),
    ("zero3_units", ["Block"], "only means something with zero_stage=3"),
    ("zero3_reshard_after_forward", False, "only means something with zero_stage=3"),
    ("zero_stage", 4, "zero_stage=4 is unknown — use one of [0, 1, 2, 3, 'auto']"),
    ("ddp_backend", "", "ddp_backend is empty"),
    ("ddp_timeout", 0.0, "ddp_timeout=0.0"),
    ("ddp_timeout", math.inf, "ddp_timeout=inf"),
    ("ddp_bucket_cap_mb", 0.0, "ddp_bucket_cap_mb=0.0"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_VALUES)
def test_a_bad_value_is_a_configuration_error_naming_the_fix(
    name: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=" — ") as raised:
        TrainingArguments(**{name: value})
    assert message in str(raised.value) or message in str(raised.value).replace("'", '"')


BAD_TYPES: list[tuple[str, Any]] = [
    ("bf16", "yes"),
    ("fp16", 1),
    ("disable_tqdm", None),
    ("gradient_checkpointing", "false"),
    ("dataloader_drop_last", 0),
    ("per_device_train_batch_size", 8.0),
    ("max_steps", True),
    ("seed", "42"),
    ("learning_rate", "1e-3"),
    ("ddp_find_unused_parameters", "no"),
    ("ddp_broadcast_buffers", 1),
    ("save_total_limit", 2.5),
    ("report_to", [1]),
    ("output_dir", 3),
    ("ddp_backend", 5),
    ("ddp_bucket_cap_mb", "25"),
]


@pytest.mark.parametrize(("name", "value"), BAD_TYPES)
def test_a_value_of_the_wrong_type_is_refused(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"{name}="):
        TrainingArguments(**{name: value})


def test_obvious_spellings_are_accepted() -> None:
    args = TrainingArguments(
        output_dir=Path("runs/x"),  # type: ignore[arg-type]
        learning_rate=1,
        report_to="csv",  # type: ignore[arg-type]
        ddp_backend=" GLOO ",
        lr_scheduler_type="Cosine",  # type: ignore[arg-type]
    )
    assert (args.output_dir, args.learning_rate, args.report_to) == ("runs/x", 1.0, ["csv"])
    assert (args.ddp_backend, args.lr_scheduler_type) == ("gloo", "cosine")
    assert TrainingArguments(report_to="none").report_to == []  # type: ignore[arg-type]


def test_bf16_and_fp16_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="choose one precision"):
        TrainingArguments(bf16=True, fp16=True)


@pytest.mark.parametrize("flag", ["ddp_find_unused_parameters", "ddp_broadcast_buffers"])
def test_gradient_checkpointing_refuses_the_ddp_flags_the_documents_warn_about(flag: str) -> None:
    with pytest.raises(ConfigurationError, match="recomput"):
        flags: dict[str, Any] = {flag: True}
        TrainingArguments(gradient_checkpointing=True, **flags)
    # Unset, they resolve to what works with checkpointing.
    assert TrainingArguments(gradient_checkpointing=True).ddp_options() == DDPOptions(
        find_unused_parameters=False, broadcast_buffers=False
    )
    assert TrainingArguments().ddp_options().broadcast_buffers is True


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed here")
def test_tensorboard_without_the_package_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="pip install tensorboard"):
        TrainingArguments(report_to=["console", "tensorboard"])


# ------------------------------------------------------------------ command line


def test_from_cli_reads_every_kind_of_flag() -> None:
    args = TrainingArguments.from_cli(
        [
            "--output_dir", "runs/cli",
            "--max-steps", "7",
            "--learning_rate", "3e-4",
            "--bf16",
            "--no-disable-tqdm",
            "--ddp_find_unused_parameters",
            "--no-ddp-broadcast-buffers",
            "--save_total_limit", "none",
            "--ddp_bucket_cap_mb", "50",
            "--report_to", "console", "csv",
        ]
    )  # fmt: skip
    assert (args.output_dir, args.max_steps, args.learning_rate) == ("runs/cli", 7, 3e-4)
    assert (args.bf16, args.disable_tqdm, args.save_total_limit) == (True, False, None)
    assert (args.ddp_find_unused_parameters, args.ddp_broadcast_buffers) == (True, False)
    assert (args.ddp_bucket_cap_mb, args.report_to) == (50.0, ["console", "csv"])
    assert TrainingArguments.from_cli(["--report_to", "none"]).report_to == []
    assert TrainingArguments.from_cli(["--ddp_bucket_cap_mb", "auto"]).ddp_bucket_cap_mb == "auto"
    assert TrainingArguments.from_cli([]) == TrainingArguments()


def test_from_cli_defaults_are_overridden_by_flags() -> None:
    defaults = {"learning_rate": 1e-3, "max_steps": 50}
    args = TrainingArguments.from_cli(["--max_steps", "9"], defaults=defaults)
    assert (args.learning_rate, args.max_steps) == (1e-3, 9)
    with pytest.raises(ConfigurationError, match="did you mean 'max_steps'"):
        TrainingArguments.from_cli([], defaults={"max_step": 3})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_steps", "many"], "invalid int value"),
        (["--bf16", "yes"], "unrecognized arguments"),
        (["--learning-rate"], "expected one argument"),
        (["--no-such-flag", "1"], "unrecognized arguments"),
        (["--per_device_train_batch_size", "0"], "must be >= 1"),
        (["--max_steps", "0"], "trains nothing"),
    ],
)
def test_from_cli_mistakes_are_configuration_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        TrainingArguments.from_cli(argv)


def test_fp16_with_zero_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="fp16 does not work with zero_stage=1 — "):
        TrainingArguments(fp16=True, zero_stage=1)


def test_from_cli_known_hands_back_the_scripts_own_flags() -> None:
    args, rest = TrainingArguments.from_cli_known(["--seed", "3", "--text", "a.txt", "--fp16"])
    assert (args.seed, args.fp16, rest) == (3, True, ["--text", "a.txt"])


def test_help_shows_each_fields_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        TrainingArguments.from_cli(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "only the last one all-reduces" in text and "--no-bf16" in text


def test_help_shows_the_scripts_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """A script's `defaults=` are what its flags default to, so --help must show them."""
    with pytest.raises(SystemExit):
        TrainingArguments.from_cli(["--help"], defaults={"learning_rate": 1e-3, "seed": 0})
    text = " ".join(capsys.readouterr().out.split())
    assert "reached after warmup_steps. (default: 0.001)" in text
    assert "the sampler's shuffle. (default: 0)" in text
    assert "(default: 5e-05)" not in text
    assert "only the last one all-reduces (the rest run no_sync). (default: 1)" in text


# ------------------------------------------------------------------ files


def test_from_json(tmp_path: Path) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"max_steps": 12, "report_to": ["csv"], "bf16": True}))
    args = TrainingArguments.from_json(path)
    assert (args.max_steps, args.report_to, args.bf16) == (12, ["csv"], True)
    path.write_text(json.dumps({"gradient_accumulation_step": 2}))
    with pytest.raises(ConfigurationError, match="did you mean 'gradient_accumulation_steps'"):
        TrainingArguments.from_json(path)
    path.write_text("{not json")
    with pytest.raises(ConfigurationError, match="not valid JSON"):
        TrainingArguments.from_json(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="not a mapping"):
        TrainingArguments.from_json(path)
    with pytest.raises(ConfigurationError, match="cannot read"):
        TrainingArguments.from_json(tmp_path / "missing.json")


def test_from_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "args.yaml"
    path.write_text("max_steps: 5\nddp_timeout: 60\nreport_to: [console]\nfp16: false\n")
    args = TrainingArguments.from_yaml(path)
    assert (args.max_steps, args.ddp_timeout, args.report_to) == (5, 60.0, ["console"])
    path.write_text("warmup_steps: -2\n")
    with pytest.raises(ConfigurationError, match="warmup_steps=-2"):
        TrainingArguments.from_yaml(path)
    path.write_text("max_steps: [unclosed\n")
    with pytest.raises(ConfigurationError, match="not valid YAML"):
        TrainingArguments.from_yaml(path)


def test_from_yaml_without_pyyaml_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` raise ImportError
    path = tmp_path / "args.yaml"
    path.write_text("max_steps: 5\n")
    with pytest.raises(ConfigurationError, match="pip install pyyaml"):
        TrainingArguments.from_yaml(path)


# ------------------------------------------------------------------ schedules


def test_learning_rate_schedules_warm_up_then_decay_to_zero() -> None:
    for kind in ("constant", "linear", "cosine"):
        factor = lr_factor(kind, warmup_steps=4, total_steps=14)
        assert [factor(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
        assert factor(14) == (1.0 if kind == "constant" else 0.0)
    assert lr_factor("linear", 4, 14)(9) == pytest.approx(0.5)
    assert lr_factor("cosine", 4, 14)(9) == pytest.approx(0.5)
    assert lr_factor("cosine", 0, 10)(2) > lr_factor("linear", 0, 10)(2)


# ------------------------------------------------------------------ checks with a model


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, batch: Tensor) -> Tensor:
        return self.fc(batch)


class _Checkpointable(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.enabled_with: dict[str, Any] | None = None

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None
    ) -> None:
        self.enabled_with = gradient_checkpointing_kwargs


def _quiet(**overrides: Any) -> TrainingArguments:
    return TrainingArguments(report_to=[], disable_tqdm=True, **overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 works on this machine's GPU")
def test_fp16_on_cpu_is_refused_with_the_alternative() -> None:
    with pytest.raises(ConfigurationError, match="use bf16=True on CPU"):
        Trainer(model=_Plain(), args=_quiet(fp16=True))


def test_gradient_checkpointing_needs_the_models_switch() -> None:
    with pytest.raises(ConfigurationError, match="_Plain has no gradient_checkpointing_enable"):
        Trainer(model=_Plain(), args=_quiet(gradient_checkpointing=True))
    model = _Checkpointable()
    Trainer(model=model, args=_quiet(gradient_checkpointing=True))
    assert model.enabled_with == {"use_reentrant": False}


def test_a_model_without_a_loss_needs_loss_fn(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 3))
    trainer = Trainer(
        model=_Plain(), args=_quiet(output_dir=str(tmp_path), max_steps=1), train_dataset=data
    )
    fc = trainer.model.fc
    assert isinstance(fc, nn.Module)
    trainer.model.forward = lambda batch: fc(batch[0])
    with pytest.raises(ConfigurationError, match="pass loss_fn="):
        trainer.train()


def test_dict_batches_are_spread_only_into_forwards_that_name_them() -> None:
    class Keyword(nn.Module):
        def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
            return input_ids

    class WholeDict(nn.Module):
        def forward(self, batch: dict[str, Tensor]) -> Tensor:
            return batch["x"]

    batch = {"input_ids": torch.zeros(1), "labels": torch.zeros(1)}
    assert takes_keyword_batch(Keyword(), batch)
    assert not takes_keyword_batch(WholeDict(), {"x": torch.zeros(1)})
    assert not takes_keyword_batch(Keyword(), {"input_ids": 1, "mask": 2})  # mask is not named
    assert not takes_keyword_batch(Keyword(), [torch.zeros(1)])


def test_a_keyword_typo_is_one_line_with_the_closest_field() -> None:
    with pytest.raises(ConfigurationError) as exc:
        TrainingArguments(output_dir="x", learning_rat=1e-3)  # type: ignore[call-arg]
    assert str(exc.value) == (
        "TrainingArguments has no field 'learning_rat' — did you mean 'learning_rate'?"
    )


def test_hugging_faces_schedules_are_transformers_own() -> None:
    transformers = pytest.importorskip("transformers")
    from phalanx.train.schedules import make_scheduler

    def lrs(scheduler: Any) -> list[float]:
        out = []
        for _ in range(20):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    ours = make_scheduler(optimizer(), "cosine_with_restarts", 4, 20, {"num_cycles": 2})
    theirs = transformers.get_cosine_with_hard_restarts_schedule_with_warmup(
        optimizer(), 4, 20, num_cycles=2
    )
    assert lrs(ours) == lrs(theirs)
    with pytest.raises(ConfigurationError, match="do not apply to lr_scheduler_type='linear'"):
        make_scheduler(optimizer(), "linear", 0, 10, {"power": 2})


@pytest.mark.parametrize(
    ("warmup_steps", "warmup_ratio", "expected"), [(3, 0.0, 3), (0.25, 0.0, 5), (0, 0.1, 2)]
)
def test_warmup_reads_steps_or_a_fraction_as_hugging_face_5(
    warmup_steps: float, warmup_ratio: float, expected: int
) -> None:
    from phalanx.train.schedules import warmup_steps_for

    args = TrainingArguments(warmup_steps=warmup_steps, warmup_ratio=warmup_ratio)
    assert warmup_steps_for(args.warmup_steps, args.warmup_ratio, 20) == expected


def test_hugging_faces_derived_defaults() -> None:
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", save_steps=20)
    assert (args.eval_steps, args.metric_for_best_model, args.greater_is_better) == (
        10,
        "loss",
        False,
    )
    args = TrainingArguments(metric_for_best_model="accuracy")
    assert args.greater_is_better is True and args.eval_strategy == "no"
    assert TrainingArguments(eval_steps=5).eval_strategy == "steps"  # phalanx's own default
    assert TrainingArguments(report_to=["none"]).report_to == []  # type: ignore[list-item]
    kwargs_json = '{"power": 2}'
    assert TrainingArguments(lr_scheduler_kwargs=kwargs_json).lr_scheduler_kwargs == {  # type: ignore[arg-type]
        "power": 2
    }
    with pytest.raises(ConfigurationError, match="save_strategy='epoch' and eval_strategy='steps'"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch")
    with pytest.raises(ConfigurationError, match='eval_strategy="no"'):
        TrainingArguments(save_strategy="best")


def test_zero_offload_fraction_is_checked() -> None:
    """The share of a disk offload in files (docs/zero.md, "Fractional offload")."""
    assert TrainingArguments(zero_stage=3, zero_offload="disk", zero_offload_fraction=0.5)
    with pytest.raises(ConfigurationError, match=r"zero_offload_fraction=1.5 must be in \[0, 1\]"):
        TrainingArguments(zero_stage=3, zero_offload="disk", zero_offload_fraction=1.5)
    with pytest.raises(ConfigurationError, match="is the share zero_offload='disk' puts"):
        TrainingArguments(zero_stage=3, zero_offload_fraction=0.5)


def test_zero_stage_auto_and_its_budget() -> None:
    """zero_stage / zero_offload "auto" (the Trainer plans them: docs/planner.md) and the
    budget they plan within, each checked in one line."""
    args = TrainingArguments(zero_stage="auto", zero_offload="auto", memory_budget_mb=800)
    assert args.plans_memory() and args.planned_choices() == ((0, 1, 2, 3), ("none", "disk", "cpu"))
    assert TrainingArguments(zero_stage=2, zero_offload="auto").planned_choices() == (
        (2,),
        ("none", "disk", "cpu"),
    )
    assert not TrainingArguments(zero_stage=1).plans_memory()
    with pytest.raises(ConfigurationError, match="zero_stage=5 is unknown"):
        TrainingArguments(zero_stage=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="memory_budget_mb is what zero_stage='auto'"):
        TrainingArguments(zero_stage=3, memory_budget_mb=800)
    with pytest.raises(ConfigurationError, match="memory_budget_mb=-1"):
        TrainingArguments(zero_stage="auto", memory_budget_mb=-1)


def test_a_stage_3_setting_keeps_zero_stage_auto_at_stage_3() -> None:
    """zero3_reshard_after_forward=False (like zero3_units) only means something at stage
    3: under zero_stage="auto" the plan is chosen among stage 3's configurations alone."""
    from phalanx.train.plan.auto import _allowed

    args = TrainingArguments(zero_stage="auto", zero3_reshard_after_forward=False)
    assert {stage for stage, _ in _allowed(args)} == {3}
    assert {stage for stage, _ in _allowed(TrainingArguments(zero_stage="auto"))} == {0, 1, 2, 3}
