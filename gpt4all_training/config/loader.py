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

from gpt4all_training.config.blocks import validate
from gpt4all_training.config.fields import shown, typed
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError

# Values a config may hold once YAML aliases are expanded: far more than any real config, far fewer than a few
# nested aliases can make.
MAX_EXPANDED_VALUES = 10_000

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


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")
