"""The typed-field engine: TrainingArguments' types, choices and flags come from its annotations.

Also DDPOptions, what TrainingArguments hands to DistributedDataParallel.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.options import DDPOptions
from phalanx.errors import ConfigurationError
from phalanx.train import TrainingArguments
from phalanx.train.config.argsio import field_docs
from phalanx.train.config.fields import Config, FieldType, field_type, field_types


@dataclass(kw_only=True, slots=True)
class _WithExtras(TrainingArguments):
    """A user's own arguments: TrainingArguments plus a few fields of the supported kinds."""

    dropout_rate: float = 0.0
    """Fraction of the run spent warming up, for scripts that prefer it to warmup_steps."""
    tags: list[str] = field(default_factory=list)
    """Free-form labels the script writes next to its metrics."""
    layer_sizes: list[int] | None = None
    """Hidden sizes of the script's model; None keeps the model's own."""
    precision: Literal["fp32", "tf32"] | None = None
    """Matmul precision the script sets; None leaves torch's default."""
    registry: ClassVar[dict[str, int]] = {}  # a class attribute, not a field: not checked


# ------------------------------------------------------------------ class definition

UNSUPPORTED: list[tuple[str, str]] = [
    ("dict[str, int]", "dict[str, int]"),
    ("Path", "Path"),
    ("tuple[int, ...]", "tuple[int, ...]"),
    ("int | str", "int | str"),
    ("list[list[int]]", "list[list[int]]"),
    ("list[int | None]", "list[int | None]"),
    ('list[Literal["a", 1]]', "list[Literal['a', 1]]"),
    ("Literal[1.5]", "Literal[1.5]"),
    ("Any", "Any"),
]


@pytest.mark.parametrize(("annotation", "spelt"), UNSUPPORTED)
def test_a_field_of_an_unsupported_type_fails_when_the_class_is_defined(
    annotation: str, spelt: str
) -> None:
    # What `class Mine(TrainingArguments): extra: <annotation> = None` does, for each annotation.
    namespace = {"__annotations__": {"extra": annotation}, "extra": None, "__module__": __name__}
    with pytest.raises(ConfigurationError) as raised:
        type("Mine", (TrainingArguments,), namespace)
    message = str(raised.value)
    assert f"Mine.extra is annotated {spelt}, which phalanx cannot check" in message
    assert "annotate it with one of: int, float, bool, str, Literal[...]" in message


def test_a_users_dataclass_subclass_is_refused_at_its_class_statement() -> None:
    with pytest.raises(ConfigurationError, match=r"Mine\.weights is annotated dict\[str, float\]"):

        @dataclass(kw_only=True, slots=True)
        class Mine(TrainingArguments):
            weights: dict[str, float] = field(default_factory=dict)
            """Per-task loss weights."""


def test_an_annotation_that_does_not_resolve_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="annotations of Mine cannot be evaluated"):

        class Mine(Config):
            extra: NoSuchType = 0  # type: ignore[name-defined]  # noqa: F821


def test_every_training_argument_has_a_supported_type() -> None:
    kinds = field_types(TrainingArguments)
    assert list(kinds) == [f.name for f in fields(TrainingArguments)]
    assert kinds["lr_scheduler_type"].choices[:3] == ("constant", "linear", "cosine")
    assert "cosine_with_restarts" in kinds["lr_scheduler_type"].choices  # Hugging Face's
    assert kinds["report_to"] == FieldType(
        "report_to",
        str,
        ("console", "jsonl", "csv", "tensorboard", "wandb", "mlflow"),
        is_list=True,
    )
    assert kinds["zero_stage"].choices == (0, 1, 2, 3, "auto")
    assert kinds["ddp_backend"] == FieldType("ddp_backend", str, optional=True)  # open: any backend


# ------------------------------------------------------------------ values


@pytest.mark.parametrize(
    ("annotation", "value", "normalized"),
    [
        (float, 3, 3.0),
        (float, True, True),  # refused by check, not turned into 1.0
        (str, Path("runs/a"), "runs/a"),
        (list[str], ("a", "b"), ["a", "b"]),
        (list[str], "a", ["a"]),
        (list[str], "None", []),
        (list[str] | None, "none", None),
        (list[float], [1, 2.5], [1.0, 2.5]),
        (Literal["linear", "cosine"], " Cosine ", "cosine"),
        (Literal["linear", "cosine"], "poly", "poly"),  # left for check to name
    ],
)
def test_obvious_spellings_are_normalized(annotation: Any, value: Any, normalized: Any) -> None:
    got = field_type(Config, "x", annotation).normalize(value)
    assert got == normalized and type(got) is type(normalized)


@pytest.mark.parametrize(
    ("annotation", "value", "message"),
    [
        (int, True, "x=True is a bool, not an integer — pass an integer"),
        (int | None, 2.5, "not an integer or None"),
        (bool | None, "no", "not True, False or None"),
        (list[int], [1, "2"], "not a list of integers"),
        (Literal[0, 1], True, "x=True is a bool, not one of [0, 1]"),
        (Literal[0, 1], 2, "x=2 is unknown — use one of [0, 1]"),
        (list[Literal["a", "b"]], ["a", "c"], "x names ['c'], which phalanx does not know"),
    ],
)
def test_a_wrong_value_names_the_field_and_what_to_pass(
    annotation: Any, value: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=" — ") as raised:
        field_type(Config, "x", annotation).check(value)
    assert message in str(raised.value)


def test_literal_choices_are_checked_in_the_constructor() -> None:
    args = TrainingArguments(report_to=["Console", "CSV"], zero_stage=0)  # type: ignore[list-item]
    assert args.report_to == ["console", "csv"]
    with pytest.raises(ConfigurationError, match=r"zero_stage='0' is a str, not one of \[0, 1"):
        TrainingArguments(zero_stage="0")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError,
        match="use one of \\['constant', 'linear', 'cosine', 'constant_with_warmup'",
    ):
        TrainingArguments(lr_scheduler_type="step")  # type: ignore[arg-type]


# ------------------------------------------------------------------ command line


def test_literal_choices_on_the_command_line() -> None:
    args = TrainingArguments.from_cli(["--lr-scheduler-type", "COSINE", "--zero_stage", "0"])
    assert (args.lr_scheduler_type, args.zero_stage) == ("cosine", 0)
    bad = [
        (["--lr_scheduler_type", "step"], "invalid choice: 'step' (choose from constant, linear"),
        (["--zero_stage", "4"], "invalid choice: '4' (choose from 0, 1, 2, 3, auto)"),
        (["--zero3_units", "Block"], "only means something with zero_stage=3"),
        (["--report_to", "console", "comet_ml"], "invalid choice: 'comet_ml'"),
        (["--report_to", "none", "csv"], "'none' stands for no value — pass it alone"),
    ]
    for argv, message in bad:
        with pytest.raises(ConfigurationError) as raised:
            TrainingArguments.from_cli(argv)
        assert message in str(raised.value), argv
    assert TrainingArguments.from_cli(["--report_to"]).report_to == []


def test_help_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        TrainingArguments.from_cli(["--help"])
    text = capsys.readouterr().out
    assert "{constant,linear,cosine,constant_with_warmup," in text and "{0,1,2,3,auto}" in text


def test_a_subclass_gets_flags_checks_and_help_for_its_own_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _WithExtras.from_cli(
        ["--dropout_rate", "1", "--tags", "a", "b", "--layer-sizes", "64", "32",
         "--precision", "TF32", "--max_steps", "3"]
    )  # fmt: skip
    assert isinstance(args, _WithExtras)
    assert (args.dropout_rate, args.tags, args.layer_sizes) == (1.0, ["a", "b"], [64, 32])
    assert (args.precision, args.max_steps) == ("tf32", 3)
    assert _WithExtras.from_cli(["--layer_sizes", "none"]).layer_sizes is None
    with pytest.raises(ConfigurationError, match="invalid int value: 'x'"):
        _WithExtras.from_cli(["--layer_sizes", "1", "x"])
    with pytest.raises(ConfigurationError, match=r"dropout_rate='0\.1' is a str, not a number"):
        _WithExtras(dropout_rate="0.1")  # type: ignore[arg-type]
    docs = field_docs(_WithExtras)
    assert (
        "Free-form labels" in docs["tags"]
        and "only the last one" in docs["gradient_accumulation_steps"]
    )
    with pytest.raises(SystemExit):
        _WithExtras.from_cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Matmul precision the script sets" in text and "{fp32,tf32}" in text


# ------------------------------------------------------------------ DDP options


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, DDPOptions(bucket_cap_mb=25.0, find_unused_parameters=False, broadcast_buffers=True)),
        ({"ddp_bucket_cap_mb": 50}, DDPOptions(bucket_cap_mb=50.0)),
        ({"ddp_bucket_cap_mb": "Auto"}, DDPOptions(bucket_cap_mb="auto")),
        ({"ddp_find_unused_parameters": True}, DDPOptions(find_unused_parameters=True)),
        ({"ddp_broadcast_buffers": False}, DDPOptions(broadcast_buffers=False)),
        ({"gradient_checkpointing": True}, DDPOptions(broadcast_buffers=False)),
        (
            {"gradient_checkpointing": True, "ddp_broadcast_buffers": False},
            DDPOptions(broadcast_buffers=False),
        ),
    ],
)
def test_ddp_options_resolve_the_unset_fields(
    overrides: dict[str, Any], expected: DDPOptions
) -> None:
    assert TrainingArguments(**overrides).ddp_options() == expected


def test_ddp_options_are_ddp_constructor_arguments_with_its_defaults() -> None:
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    for f in fields(DDPOptions):
        assert f.name in parameters, f.name
        assert f.default == parameters[f.name].default, f.name
