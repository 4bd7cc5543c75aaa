"""Load `TrainingArguments` from the command line, JSON or YAML.

The flags are generated from the dataclass itself, and their help text is
the docstring under each field, so a new field needs no parser change.
Every mistake (unknown flag, bad number, unknown key in a file) is a
`ConfigurationError` naming the field, never argparse's exit or a TypeError.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import itertools
import json
import textwrap
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx.errors import ConfigurationError

if TYPE_CHECKING:
    from phalanx.train.args import TrainingArguments

_NONE_WORDS = ("none", "null")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigurationError(f"{message} — run with --help to see every training flag")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of `cls`, read from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): flags still work, without help
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    statements = body.body
    for node, after in itertools.pairwise(statements):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if is_field and is_doc:
            assert isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            text = after.value.value  # type: ignore[attr-defined]
            docs[node.target.id] = " ".join(str(text).split())
    return docs


def _optional(convert: type) -> Any:
    """A converter that also reads "none" as None, for the `X | None` fields."""

    def parse(raw: str) -> Any:
        return None if raw.strip().lower() in _NONE_WORDS else convert(raw)

    parse.__name__ = convert.__name__  # argparse names the type in its error message
    return parse


def _add_flag(parser: argparse.ArgumentParser, f: Field[Any], help_text: str) -> None:
    """One flag per field, spelt both `--per_device_train_batch_size` and with dashes."""
    names = [f"--{f.name}"]
    if "_" in f.name:
        names.append(f"--{f.name.replace('_', '-')}")
    kind = str(f.type).replace(" ", "")
    common: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
    if kind in ("bool", "bool|None"):
        parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    elif kind == "list[str]":
        parser.add_argument(*names, nargs="*", metavar="NAME", **common)
    else:
        base, _, maybe_none = kind.partition("|")
        convert = {"int": int, "float": float, "str": str}[base]
        parser.add_argument(*names, type=_optional(convert) if maybe_none else convert, **common)


def build_parser(cls: type[TrainingArguments]) -> argparse.ArgumentParser:
    parser = _Parser(
        description="Training arguments (phalanx.TrainingArguments).",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    docs = field_docs(cls)
    for f in fields(cls):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        _add_flag(parser, f, f"{docs.get(f.name, '')} (default: {default!r})")
    return parser


def parse_cli(
    cls: type[TrainingArguments],
    argv: list[str] | None,
    defaults: Mapping[str, Any] | None,
    *,
    allow_unknown: bool,
) -> tuple[TrainingArguments, list[str]]:
    """Flags given override `defaults`, which override the field defaults.

    `--report_to none` (or the flag with no names) logs nowhere.
    """
    base = _check_keys(cls, dict(defaults or {}), "defaults")
    parser = build_parser(cls)
    if allow_unknown:
        namespace, rest = parser.parse_known_args(argv)
    else:
        namespace, rest = parser.parse_args(argv), []
    values = vars(namespace)
    if values.get("report_to") in (["none"], ["None"]):
        values["report_to"] = []
    return cls(**{**base, **values}), rest


def _check_keys(cls: type, data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"{source} holds a {type(data).__name__}, not a mapping of field names to values "
            '— write e.g. {"learning_rate": 0.001}'
        )
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see TrainingArguments for the list"
            raise ConfigurationError(f"{source} sets unknown field {key!r} — {hint}")
    return data


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path} ({exc}) — check the path") from exc


def load_json(cls: type, path: str | Path) -> dict[str, Any]:
    text = _read(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{path} is not valid JSON ({exc}) — fix the file") from exc
    return _check_keys(cls, data, str(path))


def load_yaml(cls: type, path: str | Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as exc:
        raise ConfigurationError(
            "reading YAML needs PyYAML, which is not installed — pip install pyyaml, "
            "or use TrainingArguments.from_json"
        ) from exc
    text = _read(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{path} is not valid YAML ({exc}) — fix the file") from exc
    return _check_keys(cls, {} if data is None else data, str(path))
