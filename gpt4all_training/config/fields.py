"""What one config field is: its documentation, its default, its type, and the one check of a value against it.

`typed(key, value, tp, metadata)` is the only place a config value's type is checked, for every field of every
config: the loader calls it on each value a YAML file or a `key=value` override gives, and `blocks.validate` on
every field of a config however it was built. Each mistake is one line, `{key}: {what it takes}, got {value}`.

A choice is a `Literal[...]` type (or a list of them, or either made Optional). Its error line reads
`{key}: must be {allowed}, got {value}`, where `allowed` is "one of a, b, c" unless the field words it itself
(`doc(..., allowed=...)`), as a few do to add a hint. A single choice takes one value: a list holding an allowed
value (`lr_schedule=[gpt3]`) is refused, never read as its first entry or ignored.

A field whose value names a local file or folder says so in its type: `Annotated[str, LocalPath()]` (`PathName`).
The loaders read the plain type (`typing.get_type_hints` drops the mark); `path_values` reads the marks, so that
whatever confines paths (the studio keeps every path inside its workdir) finds them in the schema, a key added later
included, instead of in a list of names that could miss one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Optional

from gpt4all_training.errors import UserError, shown


@dataclass(frozen=True)
class LocalPath:
    """The mark of a config field that names a local file or folder, or may: a Hub id or a packaged model's short
    name is a name, but the loaders read any name that exists on disk (or looks like a path) as a path.

    `within`: the field whose value the path is read inside (gguf_file, a file in model_name's folder).
    `keys`: for a mapping or a list of mappings, the keys of each mapping that name paths (rewards: module).
    `runs_code`: the file is Python that the command imports and runs.
    """
    within: Optional[str] = None
    keys: tuple[str, ...] = ()
    runs_code: bool = False


PathName = Annotated[str, LocalPath()]


class Check(NamedTuple):
    """`key` is wrong unless `ok`; the error line is `{key}: {message}, got {value}` (without the value: got=False)."""
    key: str
    ok: bool
    message: str
    got: bool = True


def quoted_choices(values: tuple[str, ...]) -> str:
    """The values as a message lists them: "'a', 'b' or 'c'"."""
    quoted = [repr(value) for value in values]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else "".join(quoted)


def path_mark(tp: Any) -> Optional[LocalPath]:
    """The LocalPath mark of a field type (inside Optional too), or None."""
    if typing.get_origin(tp) is Annotated:
        return next((mark for mark in tp.__metadata__ if isinstance(mark, LocalPath)), None)
    return next((mark for arg in typing.get_args(tp) if (mark := path_mark(arg)) is not None), None)


def path_fields(cls: type) -> dict[str, LocalPath]:
    """{field: its mark} for every field of the config class `cls` whose type marks it as a local path."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: mark for f in dataclasses.fields(cls) if (mark := path_mark(hints[f.name])) is not None}


def path_values(config: Any) -> list[tuple[str, str]]:
    """(the key as an error line names it, the path) for every local path `config` names: each marked field's
    value (read inside the field it lies `within`), and each path key of a marked mapping or list of mappings."""
    found = []
    for name, mark in path_fields(type(config)).items():
        value = getattr(config, name)
        if mark.keys:
            entries = [(name, value)] if isinstance(value, dict) else [
                (f"{name} entry {number}", entry) for number, entry in enumerate(value or [], 1)]
            found += [(f"{where} {key}", entry[key]) for where, entry in entries for key in mark.keys
                      if isinstance(entry, dict) and isinstance(entry.get(key), str)]
        elif isinstance(value, str) and value.strip():
            base = getattr(config, mark.within) if mark.within else None
            found.append((name, os.path.join(base, value) if base else value))
    return found


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


def choice_error(key: str, value: Any, tp: Any, metadata: Mapping[str, Any]) -> UserError | None:
    """The error line for a choice field whose value (or list entry) is not allowed; None when it is. A field that
    takes one choice refuses a list, even of allowed values."""
    allowed_values = choices(tp)
    if allowed_values is None or value is None:
        return None
    allowed = metadata.get("allowed") or f"one of {', '.join(allowed_values)}"
    takes_list = typing.get_origin(unwrap_optional(tp)[0]) is list
    if not takes_list and not isinstance(value, str):
        one = "takes one value, not a list; " if isinstance(value, (list, tuple, set, dict)) else ""
        return UserError(f"{key}: {one}must be {allowed}, got {shown(value)}")
    for entry in value if takes_list and isinstance(value, list) else [value]:
        if not isinstance(entry, str) or entry not in allowed_values:
            return UserError(f"{key}: must be {allowed}, got {shown(entry)}")
    return None


def typed(key: str, value: Any, tp: Any, metadata: Optional[Mapping[str, Any]] = None) -> Any:
    """`value` checked against the field type `tp`, converted where YAML is ambiguous (`5e-5` is a string in YAML
    1.1) or a Python caller passed a near relative (a Path for a string, a tuple for a list); a UserError line
    naming `key` and what it takes otherwise. `metadata` is the field's (a choice's wording of its allowed values).
    """
    base, optional = unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{key}: must not be empty (expected {type_name(base)})")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected true or false, got {shown(value)}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # YAML 1.1 reads `1e3` as a string and `1000.0` as a float; both are fine as long as they are whole.
        number = as_number(value)
        if number is not None and number.is_integer():
            return int(number)
        raise UserError(f"{key}: expected an integer, got {shown(value)}")
    if base is float:
        number = as_number(value)
        if number is None:
            raise UserError(f"{key}: expected a number, got {shown(value)}")
        # inf and nan pass every range check written as a comparison that inf satisfies (weight_decay >= 0).
        if not math.isfinite(number):
            raise UserError(f"{key}: must be a finite number, got {shown(number)}")
        return number
    if base is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key}: expected a string, got {shown(value)}")
    if typing.get_origin(base) is Literal:
        error = choice_error(key, value, tp, metadata or {})
        if error is not None:
            raise error
        return value
    if base is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise UserError(f"{key}: expected a mapping of name: value, got {shown(value)}")
        return dict(value)
    if typing.get_origin(base) is list and typing.get_args(base)[0] is dict:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) and all(isinstance(k, str) for k in v)
                                                           for v in value):
            raise UserError(f"{key}: expected a list of mappings (name: value), got {shown(value)}")
        return [dict(v) for v in value]
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{key}: expected a list of strings, got {shown(value)}")
        error = choice_error(key, list(value), tp, metadata or {})
        if error is not None:
            raise error
        return list(value)
    raise TypeError(f"unsupported config type for {key}: {tp}")  # a bug in the dataclass, not user input


def as_number(value: Any) -> float | None:
    """`value` as a float when it is a number or a numeric string (`5e-5` is a string in YAML 1.1), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int past float's range is no config value either
            return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def type_name(tp: Any) -> str:
    allowed = choices(tp)
    return f"one of {', '.join(allowed)}" if allowed else getattr(tp, "__name__", str(tp))
