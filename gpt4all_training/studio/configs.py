"""The training form: its fields from the config blocks and their docs (what `train --help` lists), the presets from
configs/train/, and saving a filled form as a config YAML that the CLI loads exactly as the studio does.

A config is saved only when it loads: the YAML is written to a temporary file and read back by `load_config`, the
CLI's own loader, so a mistake is the CLI's one line (`lr: must be > 0, got -1.0`) and a saved config is one that
`gpt4all-training train --config configs/NAME.yaml` accepts. Every config the studio loads has its paths confined
to the workdir (`Workdir.confine`, from the paths its schema marks), and a saved one never holds the studio's key.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Optional

import yaml

import gpt4all_training
from gpt4all_training.config.fields import choices, path_fields, unwrap_optional
from gpt4all_training.config.loader import load_config, read_yaml
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_file
from gpt4all_training.studio.workdir import CONFIGS_DIR, RUNS_DIR, Workdir

# The repository's presets and evaluation suite; absent from an installed wheel, where the studio offers none.
REPO_CONFIGS = Path(gpt4all_training.__file__).resolve().parents[1] / "configs"
PRESETS_DIR = REPO_CONFIGS / "train"
EVAL_SUITE_DIR = REPO_CONFIGS / "eval"
ACCELERATE_DIR = REPO_CONFIGS / "accelerate"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
MAX_VALUE_DEPTH = 32  # far deeper than any config value (a list of reward mappings is 2)


# What the form says under a field whose file is code that a run imports and runs.
RUNS_CODE_WARNING = ("A module named here is Python code: the run imports and runs it, as you, with everything you "
                     "can reach. Name only files you wrote or trust; the studio takes files inside its workdir only.")


def field_kind(tp: Any) -> str:
    """How the form edits a field of type `tp`: bool, int, float, str, choice, choices, list (of strings), mappings
    (a list of them, as JSON) or dict (as JSON)."""
    if choices(tp) is not None:
        return "choices" if typing.get_origin(unwrap_optional(tp)[0]) is list else "choice"
    base, _ = unwrap_optional(tp)
    if typing.get_origin(base) is list:
        return "mappings" if typing.get_args(base)[0] is dict else "list"
    return {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}[base]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def form_schema() -> list[dict[str, Any]]:
    """The training config's blocks, in `--help`'s order: each with its title and fields (name, kind, default,
    choices, whether it may be unset or is required, its doc, and a warning for a field that names code to run)."""
    hints = typing.get_type_hints(TrainConfig)
    code = [name for name, mark in path_fields(TrainConfig).items() if mark.runs_code]
    return [{"title": title,
             "fields": [{"name": f.name, "kind": field_kind(hints[f.name]), "default": default_of(f),
                         "choices": choices(hints[f.name]), "optional": unwrap_optional(hints[f.name])[1],
                         "required": bool(f.metadata.get("required")), "doc": f.metadata["doc"],
                         "warning": RUNS_CODE_WARNING if f.name in code else None}
                        for f in fields]}
            for title, fields in TrainConfig.groups()]


def presets(workdir: Workdir) -> dict[str, str]:
    """{name: file} of the repository's configs/train/*.yaml and the workdir's saved configs/*.yaml."""
    found = {f"configs/train/{p.name}": p for p in sorted(PRESETS_DIR.glob("*.yaml"))}
    found.update({name: workdir.path(name) for name in workdir.listing(CONFIGS_DIR, (".yaml",))})
    return {name: str(path) for name, path in found.items()}


def preset_values(workdir: Workdir, name: str) -> dict[str, Any]:
    """The keys a preset sets, over the defaults of every other key."""
    known = presets(workdir)
    if name not in known:
        raise UserError(f"preset {name}: not found; choose one of {', '.join(known) or 'none (save a config)'}")
    values = TrainConfig.__dataclass_fields__
    return {**{key: default_of(f) for key, f in values.items()}, **read_yaml(known[name])}


def saved_name(preset: str) -> Optional[str]:
    """The name a config saved by the form was saved under (configs/NAME.yaml: saving the form under NAME writes it
    again), for the form's name field; None for a repository preset or a config in a folder of its own."""
    path = PurePosixPath(preset)
    if path.parent.as_posix() == CONFIGS_DIR and path.suffix == ".yaml" and NAME.fullmatch(path.stem):
        return path.stem
    return None


def items_in(value: Any) -> Iterator[tuple[Any, int]]:
    """Every item of a config value with its depth: the value itself (0), and the keys and values of its mappings
    and lists, however deep."""
    stack = [(value, 0)]
    while stack:  # a stack of its own: a value nested deeply is no reason for Python's recursion
        item, depth = stack.pop()
        yield item, depth
        if isinstance(item, dict):
            stack += [(inner, depth + 1) for inner in (*item.keys(), *item.values())]
        elif isinstance(item, (list, tuple)):
            stack += [(inner, depth + 1) for inner in item]


def check_values(values: dict[str, Any], secrets: tuple[str, ...]) -> None:
    """Refuse, naming its key, a value nested past MAX_VALUE_DEPTH (writing it as YAML would exhaust Python's
    recursion), or one holding one of `secrets` (the studio's API key): the saved config, the run's config.yaml and
    every checkpoint would record it, and the run, whose environment lacks the key, could not know to mask it."""
    for key, value in values.items():
        for item, depth in items_in(value):
            if depth > MAX_VALUE_DEPTH:
                raise UserError(f"{key}: nested more than {MAX_VALUE_DEPTH} levels deep; no config value is")
            if isinstance(item, str) and any(secret and secret in item for secret in secrets):
                raise UserError(f"{key}: holds this studio's API key; remove it (a saved config, and every "
                                f"checkpoint of its run, would record it)")


def changed_values(values: dict[str, Any]) -> dict[str, Any]:
    """The form's values that differ from the defaults, in field order: what the saved YAML needs to say."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise UserError(f"{unknown[0]}: unknown key; the form sends the keys `train --help` lists")
    return {key: values[key] for key in fields if key in values and values[key] != default_of(fields[key])}


def save_config(workdir: Workdir, name: str, values: dict[str, Any], secrets: tuple[str, ...] = ()
                ) -> tuple[str, TrainConfig]:
    """Write configs/NAME.yaml from the form's values once the CLI's loader accepts them and its paths are inside
    the workdir; (its path relative to the workdir, the loaded config). The config's output_dir must be a folder
    under runs/, where the run list looks. `secrets`: what no value may hold (the studio's API key)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"name {name!r}: use letters, digits, '.', '_' and '-' (at most 100), e.g. chat-tiny")
    check_values({"name": name, **values}, secrets)
    folder = workdir.path(CONFIGS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}.yaml"
    with atomic_file(target) as tmp:  # loaded from the file written, and renamed into place only once accepted
        with open(tmp, "w", encoding="utf-8") as out:
            yaml.safe_dump(changed_values(values), out, sort_keys=False, allow_unicode=True)
        config = load_in(workdir, tmp)
        require_run_folder(workdir, config.output_dir)
    return workdir.relative(target), config


def load_in(workdir: Workdir, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """`load_config` as the CLI runs it from the workdir (the studio's current folder), with `overrides`; every path
    the config names confined to the workdir."""
    return workdir.confine(load_config(workdir.relative(workdir.path(str(path), "config")), overrides))


def require_run_folder(workdir: Workdir, output_dir: str) -> Path:
    """output_dir as a folder directly under runs/ (where the run list reads runs from); UserError otherwise."""
    folder = workdir.path(output_dir, "output_dir")
    if folder.parent != workdir.path(RUNS_DIR):
        raise UserError(f"output_dir {output_dir}: the studio keeps runs in {RUNS_DIR}/; set output_dir: "
                        f"{RUNS_DIR}/{Path(output_dir).name or 'NAME'}")
    return folder
