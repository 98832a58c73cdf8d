"""The training form: its fields from the config blocks and their docs (what `train --help` lists), the presets from
configs/train/, and saving a filled form as a config YAML that the CLI loads exactly as the studio does.

A config is saved only when it loads: the YAML is written to a temporary file and read back by `load_config`, the
CLI's own loader, so a mistake is the CLI's one line (`lr: must be > 0, got -1.0`) and a saved config is one that
`gpt4all-training train --config configs/NAME.yaml` accepts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

import yaml

import gpt4all_training
from gpt4all_training.config.fields import choices, unwrap_optional
from gpt4all_training.config.loader import load_config, read_yaml
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.studio.workdir import CONFIGS_DIR, RUNS_DIR, Workdir

# The repository's presets and evaluation suite; absent from an installed wheel, where the studio offers none.
REPO_CONFIGS = Path(gpt4all_training.__file__).resolve().parents[1] / "configs"
PRESETS_DIR = REPO_CONFIGS / "train"
EVAL_SUITE_DIR = REPO_CONFIGS / "eval"
ACCELERATE_DIR = REPO_CONFIGS / "accelerate"
# Config keys that name local files or folders: each must stay inside the workdir (a Hub id passes: it is a
# relative name that leads nowhere outside).
PATH_KEYS = ("model_name", "tokenizer_name", "chat_template", "dataset_path", "model_config", "output_dir",
             "cache_dir", "checkpoint", "eval_include_path")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def field_kind(tp: Any) -> str:
    """How the form edits a field of type `tp`: bool, int, float, str, choice, list or dict."""
    if choices(tp) is not None:
        return "choices" if typing.get_origin(unwrap_optional(tp)[0]) is list else "choice"
    base, _ = unwrap_optional(tp)
    if typing.get_origin(base) is list:
        return "list"
    return {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}[base]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def form_schema() -> list[dict[str, Any]]:
    """The training config's blocks, in `--help`'s order: each with its title and fields (name, kind, default,
    choices, whether it may be unset or is required, and its doc)."""
    hints = typing.get_type_hints(TrainConfig)
    return [{"title": title,
             "fields": [{"name": f.name, "kind": field_kind(hints[f.name]), "default": default_of(f),
                         "choices": choices(hints[f.name]), "optional": unwrap_optional(hints[f.name])[1],
                         "required": bool(f.metadata.get("required")), "doc": f.metadata["doc"]}
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


def check_paths(workdir: Workdir, values: dict[str, Any]) -> None:
    """Every path-valued key stays inside the workdir (OutsideWorkdir, answered 403, otherwise)."""
    for key in PATH_KEYS:
        if isinstance(values.get(key), str) and values[key].strip():
            workdir.path(values[key], key)


def changed_values(values: dict[str, Any]) -> dict[str, Any]:
    """The form's values that differ from the defaults, in field order: what the saved YAML needs to say."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise UserError(f"{unknown[0]}: unknown key; the form sends the keys `train --help` lists")
    return {key: values[key] for key in fields if key in values and values[key] != default_of(fields[key])}


def save_config(workdir: Workdir, name: str, values: dict[str, Any]) -> tuple[str, TrainConfig]:
    """Write configs/NAME.yaml from the form's values once the CLI's loader accepts them; (its path relative to the
    workdir, the loaded config). The config's output_dir must be a folder under runs/, where the run list looks."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"name {name!r}: use letters, digits, '.', '_' and '-' (at most 100), e.g. chat-tiny")
    check_paths(workdir, values)
    folder = workdir.path(CONFIGS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yaml.safe_dump(changed_values(values), out, sort_keys=False, allow_unicode=True)
        config = load_in(workdir, tmp)
        require_run_folder(workdir, config.output_dir)
        target = folder / f"{name}.yaml"
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return workdir.relative(target), config


def load_in(workdir: Workdir, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """`load_config` as the CLI runs it from the workdir (the studio's current folder), with `overrides`."""
    return load_config(workdir.relative(workdir.path(str(path), "config")), overrides)


def require_run_folder(workdir: Workdir, output_dir: str) -> Path:
    """output_dir as a folder directly under runs/ (where the run list reads runs from); UserError otherwise."""
    folder = workdir.path(output_dir, "output_dir")
    if folder.parent != workdir.path(RUNS_DIR):
        raise UserError(f"output_dir {output_dir}: the studio keeps runs in {RUNS_DIR}/; set output_dir: "
                        f"{RUNS_DIR}/{Path(output_dir).name or 'NAME'}")
    return folder
