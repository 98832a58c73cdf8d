"""What one config field is: its documentation, its default, and, for a choice, the values it allows.

A choice is a `Literal[...]` type (or a list of them, or either made Optional); `choice_error` is the one check of
such a value and words the one error line, `{key}: must be {allowed}, got {value}`. `allowed` reads
"one of a, b, c" unless the field words it itself (`doc(..., allowed=...)`), as a few do to add a hint.
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from typing import Any, Literal

from gpt4all_training.errors import UserError


def doc(text: str, default: Any = None, *, factory: Any = None, required: bool = False,
        allowed: str | None = None) -> Any:
    """A dataclass field with its documentation attached (shown by `--help`).

    `required`: the config is invalid while the field is unset. `allowed`: how a choice's error line words the
    allowed values, where "one of a, b, c" would say less than the field needs.
    """
    metadata: dict[str, Any] = {"doc": text}
    if required:
        metadata["required"] = True
    if allowed is not None:
        metadata["allowed"] = allowed
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(the type inside `Optional[...]`, True), or (tp, False) when None is not allowed."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def choices(tp: Any) -> tuple[str, ...] | None:
    """The values a `Literal` field (or a list of `Literal`s) allows; None for any other type."""
    base, _ = unwrap_optional(tp)
    if typing.get_origin(base) is list:
        base = typing.get_args(base)[0]
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def choice_error(key: str, value: Any, tp: Any, metadata: typing.Mapping[str, Any]) -> UserError | None:
    """The error line for a choice field whose value (or list entry) is not allowed; None when it is."""
    allowed_values = choices(tp)
    if allowed_values is None or value is None:
        return None
    for entry in value if isinstance(value, list) else [value]:
        if not isinstance(entry, str) or entry not in allowed_values:
            allowed = metadata.get("allowed") or f"one of {', '.join(allowed_values)}"
            return UserError(f"{key}: must be {allowed}, got {shown(entry)}")
    return None


def shown(value: Any) -> str:
    """`value` for an error line: repr, cut short (a YAML alias can make a list of millions from a few lines)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlist = short.maxdict = 4
    short.maxlevel = 2
    return short.repr(value)
