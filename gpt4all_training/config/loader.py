"""Loading a config: YAML with `key=value` overrides, typed by the dataclass fields, then validated.

Works for any of the configs in `config/schemas.py`. Each value is checked against its field's type by
`fields.typed`, which settles YAML 1.1's ambiguities (`5e-5` is a string to YAML, a float here). An unknown key gets
the closest valid name, or ours for the name TRL, transformers or axolotl give the same setting. A mistake gives one
`UserError` line that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from gpt4all_training.config.blocks import Block, validate
from gpt4all_training.config.fields import shown, typed
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_write
from gpt4all_training.readers import read_yaml as read_yaml_file
from gpt4all_training.readers import yaml_problem

# The names TRL, transformers (TrainingArguments) and axolotl give settings we have under another name: a user who
# brings a config from them types these. {their name: (ours, a hint where the value is written differently)}.
FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    "learning_rate": ("lr", ""),
    "per_device_train_batch_size": ("batch_size", ""),
    "micro_batch_size": ("batch_size", ""),
    "num_train_epochs": ("num_epochs", ""),
    "lr_scheduler_type": ("lr_schedule", ""),
    "lr_scheduler": ("lr_schedule", ""),
    "max_seq_length": ("max_length", ""),
    "sequence_len": ("max_length", ""),
    "logging_steps": ("log_every", ""),
    "save_steps": ("save_every", ""),
    "save_total_limit": ("keep_last", ""),
    "resume_from_checkpoint": ("checkpoint", "a step_N folder, or resume: auto for the newest"),
    "hub_model_id": ("save_name", ""),
    "model_name_or_path": ("model_name", ""),
    "base_model": ("model_name", ""),
    "dataset_name": ("dataset_path", ""),
    "datasets": ("dataset_path", "one path or Hub id"),
    "dataset_text_field": ("text_field", ""),
    "dataset_num_proc": ("num_proc", ""),
    "dataset_prepared_path": ("cache_dir", ""),
    "val_set_size": ("val_fraction", "a share of the data, e.g. 0.05"),
    "sample_packing": ("packing", ""),
    "torch_dtype": ("dtype", ""),
    "bf16": ("dtype", "bf16: true is dtype: bfloat16"),
    "fp16": ("dtype", "fp16: true is dtype: float16"),
    "torch_compile": ("compile", ""),
    "use_peft": ("lora", ""),
    "adapter": ("lora", "adapter: lora is lora: true"),
    "data_seed": ("seed", ""),
    "warmup_ratio": ("warmup_steps", "in optimizer steps, not a share of them"),
    "cosine_min_lr_ratio": ("min_lr", "a learning rate, not a share of lr"),
    "rl": ("objective", "rl: dpo is objective: dpo"),
    "wandb_project": ("wandb_project_name", ""),
}


def config_fields(cls: type = TrainConfig) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


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


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config {path}: file not found; pass an existing YAML file to --config")
    data = read_yaml_file(path, "config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config {path}: expected a mapping of key: value at the top level")
    return data


def check_keys(values: dict[str, Any], cls: type, source: str) -> None:
    """Reject the first key `cls` does not have, suggesting ours for another tool's name of it, else the closest
    valid name."""
    fields = config_fields(cls)
    for key in values:
        if not isinstance(key, str) or key not in fields:
            ours, how = FOREIGN_KEYS.get(key, ("", "")) if isinstance(key, str) else ("", "")
            if ours in fields:
                hint = f"; did you mean {ours!r}? ({how or f'{key} is what TRL, transformers or axolotl call it'})"
            else:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
            name = key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else shown(key)
            raise UserError(f"{name}: unknown key in {source}{hint}")


def build_config(values: dict[str, Any], cls: type = TrainConfig, source: str = "config") -> Any:
    check_keys(values, cls, source)
    hints = typing.get_type_hints(cls)
    fields = config_fields(cls)
    return cls(**{key: typed(key, value, hints[key], fields[key].metadata) for key, value in values.items()})


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


def save_config(config: Block, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
