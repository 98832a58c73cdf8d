"""Loading a config: YAML with `key=value` overrides, typed by the dataclass fields, then validated.

Works for any of the configs in `config/schemas.py`. YAML 1.1's ambiguities are settled by the field's type (`5e-5`
is a string to YAML, a float here); a choice (`Literal`) is checked by `fields.choice_error`; an unknown key gets the
closest valid name. A mistake gives one `UserError` line that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

import yaml

from gpt4all_training.config.blocks import validate
from gpt4all_training.config.fields import choice_error, choices, shown, unwrap_optional
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError

# Values a config may hold once YAML aliases are expanded: far more than any real config, far fewer than a few
# nested aliases can make.
MAX_EXPANDED_VALUES = 10_000

def config_fields(cls: type = TrainConfig) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def coerce(key: str, value: Any, tp: Any, metadata: Optional[Mapping[str, Any]] = None) -> Any:
    """Check `value` against the field type `tp`, converting where YAML is ambiguous (`5e-5` is a string in YAML 1.1).

    `metadata` is the field's (a choice's wording of its allowed values)."""
    base, optional = unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{key}: must not be empty (expected {_type_name(base)})")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected true or false, got {shown(value)}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # YAML 1.1 reads `1e3` as a string and `1000.0` as a float; both are fine as long as they are whole.
        number = _number(value)
        if number is not None and number.is_integer():
            return int(number)
        raise UserError(f"{key}: expected an integer, got {shown(value)}")
    if base is float:
        number = _number(value)
        if number is None:
            raise UserError(f"{key}: expected a number, got {shown(value)}")
        return number
    if base is str:
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
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{key}: expected a list of strings, got {shown(value)}")
        error = choice_error(key, value, tp, metadata or {})
        if error is not None:
            raise error
        return list(value)
    raise TypeError(f"unsupported config type for {key}: {tp}")  # a bug in the dataclass, not user input


def _number(value: Any) -> float | None:
    """`value` as a float when it is a number or a numeric string (`5e-5` is a string in YAML 1.1), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(tp: Any) -> str:
    allowed = choices(tp)
    return f"one of {', '.join(allowed)}" if allowed else getattr(tp, "__name__", str(tp))


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` strings from the command line; values are parsed as YAML scalars, then typed by the field."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"override {pair!r}: expected key=value, for example lr=1e-4")
        key, raw = pair.split("=", 1)
        try:
            problem = yaml_problem(raw)
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except (yaml.YAMLError, RecursionError):  # not YAML (or nested too deeply): the text itself
            out[key.strip()] = raw
            continue
        if problem:
            raise UserError(f"{key.strip()}: in the command-line override, {problem}")
    return out


def yaml_problem(text: str) -> str | None:
    """A key written twice in one mapping (YAML keeps the last silently), or aliases that expand to more than
    MAX_EXPANDED_VALUES values (a few lines can make billions, and copying the config would then never end); None
    when neither. Read from the node graph, which constructs nothing and holds an alias as one shared node, so it
    costs what the text costs."""
    root = yaml.compose(text)
    if root is None:
        return None
    sizes: dict[int, int] = {}  # values under each node, aliases expanded
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([] if isinstance(node, yaml.ScalarNode)
                    else [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value))
        if not children_done:
            if id(node) in open_nodes:
                return f"an alias refers to itself (line {node.start_mark.line + 1}); write the value out"
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        open_nodes.discard(id(node))
        sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        if sizes[id(node)] > MAX_EXPANDED_VALUES:
            return (f"YAML aliases expand to more than {MAX_EXPANDED_VALUES:,} values (line "
                    f"{node.start_mark.line + 1}); write the values out")
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    continue
                line = key.start_mark.line + 1
                if (key.tag, key.value) in seen:
                    return (f"key {shown(key.value)} is written twice (lines {seen[key.tag, key.value]} and {line}); "
                            f"keep one")
                seen[key.tag, key.value] = line
    return None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config {path}: file not found; pass an existing YAML file to --config")
    try:
        text = path.read_text(encoding="utf-8")
        problem = yaml_problem(text)
        data = None if problem else yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"config {path}: not valid YAML{where}; check the syntax") from None
    if problem:
        raise UserError(f"config {path}: {problem}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config {path}: expected a mapping of key: value at the top level")
    return data


def check_keys(values: dict[str, Any], cls: type, source: str) -> None:
    """Reject the first key `cls` does not have, suggesting the closest valid name."""
    fields = config_fields(cls)
    for key in values:
        if not isinstance(key, str) or key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            name = key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else shown(key)
            raise UserError(f"{name}: unknown key in {source}{hint}")


def build_config(values: dict[str, Any], cls: type = TrainConfig, source: str = "config") -> Any:
    check_keys(values, cls, source)
    hints = typing.get_type_hints(cls)
    fields = config_fields(cls)
    return cls(**{key: coerce(key, value, hints[key], fields[key].metadata) for key, value in values.items()})


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type = TrainConfig,
                check: Optional[Callable[[Any], Any]] = validate) -> Any:
    """Read the YAML at `path` (if any), apply `key=value` overrides, type-check and validate.

    `check=None` leaves validation to a caller that first sets fields of its own (generate's --prompt)."""
    values = read_yaml(path) if path else {}
    from_command_line = parse_overrides(overrides or [])
    # Check each source on its own, so an unknown key's error says where it was written.
    check_keys(values, cls, str(path))
    check_keys(from_command_line, cls, "the command-line overrides")
    config = build_config({**values, **from_command_line}, cls)
    return check(config) if check else config


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")
