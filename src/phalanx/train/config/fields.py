"""Typed config fields: checks, spellings and command-line flags, read from the annotations.

A config class (`TrainingArguments`, or a user's subclass of it) derives
from `Config` and annotates its fields with the kinds below; nothing else
lists its field names or types. From each annotation `FieldType` knows how
to accept the obvious spellings of a value, refuse a value of the wrong
type (naming the field and what to pass), and build the field's argparse
flag. An annotation of another kind is an error when the class is defined,
not when a user first runs the script with that flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from phalanx.errors import ConfigurationError

SUPPORTED_KINDS = (
    "int, float, bool, str, Literal[...] of str or of int (or both), float | Literal[...] of str, "
    "dict[str, Any], X | None, list[X]"
)
# What the command line (and a string for a list field) reads as None or an empty list.
NONE_WORDS = ("none", "null")
_SCALARS = (int, float, bool, str)
_ANY_OF = {int: "integers", float: "numbers", bool: "True/False values", str: "strings"}
_ONE = {
    int: "an integer",
    float: "a number",
    bool: "True or False",
    str: "a string",
    dict: "a dict (JSON on the command line)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class FieldType:
    """What one field's annotation allows, reduced to the kinds the engine supports."""

    name: str
    """The field's name, for messages and the flag."""
    scalar: type
    """int, float, bool or str: the type of the value, or of each item of a list."""
    choices: tuple[str | int, ...] = ()
    """The values a Literal allows, in its order; empty for an open type."""
    optional: bool = False
    """The annotation is `X | None`."""
    is_list: bool = False
    """The annotation is `list[X]` (or `list[X] | None`)."""
    words: tuple[str, ...] = ()
    """Names a number field also takes: `float | Literal["auto"]` is a float or "auto"."""

    # ------------------------------------------------------------ values

    def normalize(self, value: Any) -> Any:
        """Accept the obvious spellings: an int for a float, a Path for a str, a tuple for a
        list, a single name (or "none") for a list, any case of a Literal's name."""
        if value is None:
            return None
        if not self.is_list:
            return self._normalize_item(value)
        if isinstance(value, str):
            if value.strip().lower() in NONE_WORDS:
                return None if self.optional else []
            value = [value]
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, list) and [str(v).strip().lower() for v in value] == ["none"]:
            return None if self.optional else []  # HF's report_to=["none"]
        if isinstance(value, list):
            return [self._normalize_item(item) for item in value]
        return value

    def _normalize_item(self, value: Any) -> Any:
        if self.scalar is dict and isinstance(value, str):
            return _read_json_object(value)  # HF takes a JSON string for its dict fields too
        if self.words and isinstance(value, str):
            return next((w for w in self.words if w == value.strip().lower()), value)
        if self.scalar is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if self.scalar is str and isinstance(value, os.PathLike):
            return str(value)
        if self.choices and self.scalar is str and isinstance(value, str):
            wanted = value.strip().lower()
            return next((c for c in self.choices if str(c).lower() == wanted), value)
        return value

    def check(self, value: Any) -> None:
        """Raise a ConfigurationError naming the field unless `value` fits the annotation."""
        if value is None and self.optional:
            return
        if self.is_list:
            if not isinstance(value, list) or not all(map(self._is_item, value)):
                raise self._wrong_type(value)
            unknown = [item for item in value if self.choices and item not in self.choices]
            if unknown:
                raise ConfigurationError(
                    f"{self.name} names {unknown}, which phalanx does not know — use any "
                    f"of {list(self.choices)}"
                )
            return
        if not self._is_item(value):
            raise self._wrong_type(value)
        if self.choices and value not in self.choices:
            raise ConfigurationError(
                f"{self.name}={value!r} is unknown — use one of {list(self.choices)}"
            )

    def _is_item(self, value: Any) -> bool:
        # bool is an int to Python, but True is no batch size (and no ZeRO stage).
        if isinstance(value, str) and value in self.words:
            return True
        return isinstance(value, self.scalar) and (
            self.scalar is bool or not isinstance(value, bool)
        )

    def expected(self) -> str:
        """What to pass, in words: "an integer or None", 'a list of any of ["csv"]'."""
        if self.is_list:
            what = f"any of {list(self.choices)}" if self.choices else _ANY_OF[self.scalar]
            alternatives = [f"a list of {what}"]
        elif self.choices:
            alternatives = [f"one of {list(self.choices)}"]
        elif self.scalar is bool:
            alternatives = ["True", "False"]
        else:
            alternatives = [_ONE[self.scalar], *(repr(w) for w in self.words)]
        if self.optional:
            alternatives.append("None")
        if len(alternatives) == 1:
            return alternatives[0]
        return ", ".join(alternatives[:-1]) + " or " + alternatives[-1]

    def _wrong_type(self, value: Any) -> ConfigurationError:
        expected = self.expected()
        return ConfigurationError(
            f"{self.name}={value!r} is a {type(value).__name__}, not {expected} — pass {expected}"
        )

    # ------------------------------------------------------------ command line

    def add_flag(self, parser: argparse.ArgumentParser, help_text: str) -> None:
        """`--name` (and `--na-me`): bool as --x/--no-x, lists as --x A B, "none" for None."""
        names = [f"--{self.name}"]
        if "_" in self.name:
            names.append(f"--{self.name.replace('_', '-')}")
        common: dict[str, Any] = {
            "dest": self.name,
            "default": argparse.SUPPRESS,
            "help": help_text,
        }
        if self.choices:
            common["metavar"] = "{" + ",".join(map(str, self.choices)) + "}"
        if self.scalar is bool and not self.is_list:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif self.is_list:
            convert = _accepting_none(self._convert_item())
            parser.add_argument(
                *names, nargs="*", type=convert, action=_ListFlag, optional=self.optional, **common
            )
        else:
            convert = self._convert_item()
            if self.optional:
                convert = _accepting_none(convert)
            parser.add_argument(*names, type=convert, **common)

    def _convert_item(self) -> Callable[[str], Any]:
        """A converter from one command-line word; argparse names its __name__ in errors."""
        if self.choices:
            return self._choose
        if self.scalar is bool:
            return _read_bool
        if self.words:
            return self._number_or_word
        if self.scalar is dict:
            return _read_json_object
        return self.scalar

    def _number_or_word(self, raw: str) -> Any:
        word = raw.strip().lower()
        return word if word in self.words else self.scalar(raw)

    def _choose(self, raw: str) -> Any:
        for choice in self.choices:
            if str(choice).lower() == raw.strip().lower():
                return choice
        raise argparse.ArgumentTypeError(
            f"invalid choice: {raw!r} (choose from {', '.join(map(str, self.choices))})"
        )


def _read_json_object(raw: str) -> Any:
    """A JSON object from a string; anything else is returned for check() to refuse."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


def _read_bool(raw: str) -> bool:
    """One item of a list[bool] flag (a single bool field is --x / --no-x instead)."""
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if raw.strip().lower() not in words:
        raise argparse.ArgumentTypeError(f"invalid bool value: {raw!r} (pass true or false)")
    return words[raw.strip().lower()]


def _accepting_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A converter that also reads "none" as None."""

    def parse(raw: str) -> Any:
        return None if raw.strip().lower() in NONE_WORDS else convert(raw)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse: "invalid int value"
    return parse


class _ListFlag(argparse.Action):
    """`--x a b` is [a, b]; a bare `--x` is []; `--x none` is [] too, or None if optional."""

    def __init__(self, *args: Any, optional: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optional = optional

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = list(values or [])
        if items == [None]:
            setattr(namespace, self.dest, None if self.optional else [])
        elif None in items:
            raise argparse.ArgumentError(self, "'none' stands for no value — pass it alone")
        else:
            setattr(namespace, self.dest, items)


# --------------------------------------------------------------------- annotations


def field_type(owner: type, name: str, hint: Any) -> FieldType:
    """Reduce one annotation to a FieldType, or raise naming the field and the kinds allowed."""
    inner, optional = _strip_none(hint)
    is_list = get_origin(inner) is list and len(get_args(inner)) == 1
    item = get_args(inner)[0] if is_list else inner
    if item in _SCALARS:
        return FieldType(name, item, (), optional, is_list)
    if get_origin(item) is dict and get_args(item) == (str, Any) and not is_list:
        return FieldType(name, dict, (), optional, False)
    words = _number_or_words(inner)
    if words is not None:
        return FieldType(name, words[0], (), optional, False, words[1])
    if get_origin(item) is Literal:
        choices = get_args(item)
        for scalar in (str, int):
            if all(type(c) is scalar for c in choices):
                return FieldType(name, scalar, choices, optional, is_list)
        names = tuple(str(c) for c in choices if type(c) is str)
        if not is_list and all(type(c) in (int, str) for c in choices):  # Literal[0, 1, "auto"]
            return FieldType(name, int, choices, optional, False, names)
    raise ConfigurationError(
        f"{owner.__name__}.{name} is annotated {_spell(hint)}, which phalanx cannot check or "
        f"read from the command line — annotate it with one of: {SUPPORTED_KINDS}"
    )


def _number_or_words(hint: Any) -> tuple[type, tuple[str, ...]] | None:
    """`float | Literal["auto"]` -> (float, ("auto",)); anything else -> None."""
    if get_origin(hint) not in (Union, types.UnionType):
        return None
    args = get_args(hint)
    numbers = [a for a in args if a in (int, float)]
    literals = [a for a in args if get_origin(a) is Literal]
    if len(numbers) != 1 or len(literals) != 1 or len(args) != 2:
        return None
    words = get_args(literals[0])
    if not all(isinstance(w, str) for w in words):
        return None
    return numbers[0], tuple(words)


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); any other hint -> (hint, False)."""
    if get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint):
        rest = tuple(arg for arg in get_args(hint) if arg is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True  # noqa: UP007
    return hint, False


def _spell(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def field_types(cls: type) -> dict[str, FieldType]:
    """Every annotated field of `cls` and its bases, in definition order, as a FieldType."""
    try:
        hints = get_type_hints(cls)
    except Exception as exc:  # NameError, or a TypeError from `X | Y` on an old type
        raise ConfigurationError(
            f"the annotations of {cls.__name__} cannot be evaluated ({type(exc).__name__}: "
            f"{exc}) — import every name they use at module level"
        ) from exc
    return {
        name: field_type(cls, name, hint)
        for name, hint in hints.items()
        if get_origin(hint) is not ClassVar and hint is not ClassVar
    }


def check_fields(config: Any) -> None:
    """Normalise every field of a config dataclass in place, then check its type."""
    kinds = field_types(type(config))
    for f in dataclasses.fields(config):
        before = getattr(config, f.name)
        value = kinds[f.name].normalize(before)
        if value is not before:
            object.__setattr__(config, f.name, value)  # frozen dataclasses too
        kinds[f.name].check(value)


class Config:
    """Base of config dataclasses: an unsupported field type fails when the class is defined.

    That includes a user's subclass that adds a field, so a typo'd or
    exotic annotation is found at import, not on a cluster an hour later.
    """

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        field_types(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A keyword no field has is one line with the closest field's name (the dataclass's
        own `__init__` would say only "unexpected keyword argument")."""
        known: list[str] = (
            [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        )
        for key in kwargs:
            if known and key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see its fields in the docs"
                raise ConfigurationError(f"{cls.__name__} has no field {key!r} — {hint}")
        return super().__new__(cls)


def require(ok: bool, message: str) -> None:
    """Raise ConfigurationError(message) unless `ok`: a config check in one line."""
    if not ok:
        raise ConfigurationError(message)
