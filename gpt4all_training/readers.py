"""The files a user hands a command, read by one reader per kind: text, a JSON file, a YAML file, a list of values
one per line, and a model folder's config.json. Every command reads its inputs through these, so any problem with
a file (missing, a folder, unreadable, not UTF-8, not JSON or YAML, nested past reason, aliases that expand to
millions of values, a key written twice, a config.json that names code of its own) is the same one `UserError` line
naming the file and, where there is one, the line; never a traceback.

Each reader takes `what`, the name the user gave the file by (`--compare`, `config`, `prompts_file`), which starts
its lines. Dataset record files (JSONL, JSON, CSV, Parquet) have their own reader in `data/records.py`, which counts
and reports bad records instead of stopping at the first.

The lowest layer, beside `errors`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from gpt4all_training.errors import UserError, shown

# Values a YAML file may hold once its aliases are expanded: far more than any real config, far fewer than a few
# nested aliases can make.
MAX_EXPANDED_VALUES = 10_000


def shown_path(path: Path) -> str:
    return str(path) if str(path).isprintable() else repr(str(path))


def read_text(path: str | Path, what: str) -> str:
    """The file's text, UTF-8 (a byte-order mark is dropped)."""
    path = Path(path)
    name = f"{what} {shown_path(path)}"
    if path.is_dir():
        raise UserError(f"{name}: is a folder; give a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{name}: does not exist") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"{name}:{line}: not UTF-8 text (byte {exc.start}); re-encode the file as UTF-8") from None


def parse_json(text: str, where: str) -> Any:
    """`text` as JSON; `where` names it in the error line ("--compare results.json", "FILE:3")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError:  # the one other refusal: an integer of more than 4,300 digits, which Python will not convert
        raise UserError(f"{where}: not valid JSON (a number too long to read)") from None


def read_json(path: str | Path, what: str) -> Any:
    return parse_json(read_text(path, what), f"{what} {shown_path(Path(path))}")


def read_lines(path: str | Path, what: str) -> list[str]:
    """A list of values one per line: each line stripped, blank lines left out."""
    return [line.strip() for line in read_text(path, what).splitlines() if line.strip()]


def yaml_problem(text: str) -> str | None:
    """A key written twice in one mapping (YAML keeps the last silently), or aliases that expand to more than
    MAX_EXPANDED_VALUES values (a few lines can make billions, and copying the result would then never end); None
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
                    first = seen[key.tag, key.value]
                    return f"key {shown(key.value)} is written twice (lines {first} and {line}); keep one"
                seen[key.tag, key.value] = line
    return None


def parse_yaml(text: str, where: str) -> Any:
    """`text` as YAML (safe_load: plain values only, no Python tags), checked by `yaml_problem` first."""
    try:
        problem = yaml_problem(text)
        data = None if problem else yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: nested too deeply
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"{where}: not valid YAML{at}; check the syntax") from None
    if problem:
        raise UserError(f"{where}: {problem}")
    return data


def read_yaml(path: str | Path, what: str) -> Any:
    return parse_yaml(read_text(path, what), f"{what} {shown_path(Path(path))}")


def read_model_config(folder: str | Path, what: str) -> dict[str, Any]:
    """A model folder's config.json: a JSON object naming its `model_type`, and no `auto_map` (code shipped with the
    model, which this program does not run)."""
    path = Path(folder) / "config.json"
    where = f"{what} {shown_path(path)}"
    config = read_json(path, what)
    if not isinstance(config, dict):
        raise UserError(f"{where}: expected a JSON object of the model's settings")
    if config.get("auto_map"):
        raise UserError(f"{where}: the model names code of its own (auto_map), which this program does not run; "
                        f"use a model whose architecture transformers has built in")
    if not isinstance(config.get("model_type"), str):
        raise UserError(f"{where}: names no model_type; it is not a transformers model's config.json")
    return config
