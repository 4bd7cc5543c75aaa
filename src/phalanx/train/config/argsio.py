"""Load `TrainingArguments` from the command line, JSON or YAML.

The flags are generated from the dataclass itself (`fields.FieldType` turns
each annotation into its flag), and their help text is the docstring under
each field, so a new field, in TrainingArguments or a subclass, needs no
parser change.
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
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from phalanx.errors import ConfigurationError
from phalanx.train.config.fields import field_types

if TYPE_CHECKING:
    from phalanx.train.config.args import TrainingArguments

_Args = TypeVar("_Args", bound="TrainingArguments")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigurationError(f"{message} — run with --help to see every training flag")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of `cls` and of its bases, read from their source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (builtins, a frozen app): flags work without help
        return {}
    classes = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    statements = classes[0].body if classes else []
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(statements):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def build_parser(
    cls: type[TrainingArguments], defaults: Mapping[str, Any] | None = None
) -> argparse.ArgumentParser:
    """Flags for every field; `--help` shows `defaults` (the script's) where given."""
    parser = _Parser(
        description=f"Training arguments (phalanx.{cls.__name__}).",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    docs = field_docs(cls)
    kinds = field_types(cls)
    shown = dict(defaults or {})
    for f in fields(cls):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        default = shown.get(f.name, default)
        kinds[f.name].add_flag(parser, f"{docs.get(f.name, '')} (default: {default!r})")
    return parser


def parse_cli(
    cls: type[_Args],
    argv: list[str] | None,
    defaults: Mapping[str, Any] | None,
    *,
    allow_unknown: bool,
) -> tuple[_Args, list[str]]:
    """Flags given override `defaults`, which override the field defaults.

    `--report_to none` (or the flag with no names) logs nowhere.
    """
    base = _check_keys(cls, dict(defaults or {}), "defaults")
    parser = build_parser(cls, base)
    if allow_unknown:
        namespace, rest = parser.parse_known_args(argv)
    else:
        namespace, rest = parser.parse_args(argv), []
    return cls(**{**base, **vars(namespace)}), rest


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
