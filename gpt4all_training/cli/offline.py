"""Offline by default: when every model, tokenizer, dataset and evaluation task a command names is local (a path, a
packaged model's short name, a task YAML whose data is local), HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set before
transformers, huggingface_hub or datasets are imported, which read them once, at import. Otherwise a library may
spend its retries on the Hub for a file that is on disk. A value the user set for either variable is kept.

The names are read from the command line as typed, before argparse runs (building the parser imports the
subcommand's module, and with it those libraries): `--config FILE` and its `key=value` overrides, and the options
that name a model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from gpt4all_training.model.names import is_local

VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# Config keys that name something on disk or on the Hub.
SOURCE_KEYS = ("model_name", "tokenizer_name", "dataset_path", "model_config")
# Options that name a model.
SOURCE_OPTIONS = ("--model", "--from", "--base")
# datasets' builders that read local files (a task YAML's dataset_path: json with data_files, say).
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow"})


def option_values(argv: list[str], option: str) -> list[str]:
    """Every value of `option` in argv, written `--option VALUE` or `--option=VALUE`."""
    values = []
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(option + "="):
            values.append(arg.split("=", 1)[1])
    return values


def config_values(argv: list[str]) -> dict | None:
    """The --config file's values with the key=value overrides over them; None when it cannot be read (the command
    itself reports that)."""
    values: dict = {}
    for path in option_values(argv, "--config")[:1]:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
        if not isinstance(loaded, dict):
            return None
        values.update(loaded)
    for arg in argv:
        key, separator, value = arg.partition("=")
        if separator and not key.startswith("-") and key.isidentifier():
            values[key] = value
    return values


class TaskFileLoader(yaml.SafeLoader):
    """lm-evaluation-harness task files tag Python hooks (`!function module.name`): read them as plain strings."""


TaskFileLoader.add_multi_constructor("!", lambda loader, suffix, node: f"{suffix} {loader.construct_scalar(node)}")


def safe_task_file(text: str):
    """The task file's YAML through TaskFileLoader, a SafeLoader: no tag builds a Python object."""
    loader = TaskFileLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def task_files(include_paths: list[str]) -> list[dict]:
    found = []
    for folder in include_paths:
        for path in sorted(Path(folder).rglob("*.yaml")) if Path(folder).is_dir() else []:
            try:
                task = safe_task_file(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if isinstance(task, dict):
                found.append(task)
    return found


def task_names(task: dict) -> set[str]:
    names = set()
    for key in ("task", "tag", "group"):
        value = task.get(key)
        names |= {value} if isinstance(value, str) else {v for v in value or () if isinstance(v, str)}
    return names


def task_data_is_local(task: dict) -> bool:
    """A task reads local data: its own Python loader (custom_dataset), a local-file builder, or a local folder."""
    path = task.get("dataset_path")
    return "custom_dataset" in task or (isinstance(path, str) and (path in LOCAL_BUILDERS or Path(path).exists()))


def tasks_are_local(tasks: list[str], include_paths: list[str]) -> bool:
    """Whether every task (a name, tag or group defined in an include path, or a task YAML file) reads local data;
    a name the harness would look up among its own tasks downloads its data from the Hub."""
    defined = task_files(include_paths)
    for name in tasks:
        if name.endswith((".yaml", ".yml")):
            matching = task_files([str(Path(name).parent)]) if Path(name).is_file() else []
        else:
            matching = [task for task in defined if name in task_names(task)]
        if not matching or not all(task_data_is_local(task) for task in matching):
            return False
    return True


def named_sources(argv: list[str]) -> list[str] | None:
    """The models and datasets the command line names, or None when one of them needs the Hub (or the config cannot
    be read). model_config names a model type (gptj) unless it holds a `/`."""
    config = config_values(argv)
    if config is None:
        return None
    names = [str(config[key]) for key in SOURCE_KEYS if config.get(key) not in (None, "", "null")]
    names += [value for option in SOURCE_OPTIONS for value in option_values(argv, option)]
    model_config = str(config.get("model_config") or "")
    hub = [name for name in names if not is_local(name) and not (name == model_config and "/" not in name)]
    tasks = [t.strip() for value in option_values(argv, "--tasks") for t in value.split(",") if t.strip()]
    eval_tasks = config.get("eval_tasks")
    tasks += [eval_tasks] if isinstance(eval_tasks, str) else [t for t in eval_tasks or () if isinstance(t, str)]
    include_paths = option_values(argv, "--include-path") + [str(p) for p in [config.get("eval_include_path")] if p]
    if hub or not tasks_are_local(tasks, include_paths):
        return None
    return names


def go_offline_if_local(argv: list[str]) -> str | None:
    """Set the offline variables when everything argv names is local and the user set neither; the one line that
    says so (None when nothing was set)."""
    if any(variable in os.environ for variable in VARIABLES):
        return None
    names = named_sources(argv)
    if not names:
        return None
    for variable in VARIABLES:
        os.environ[variable] = "1"
    return (f"offline: everything this command names is on this machine ({', '.join(dict.fromkeys(names))}), so "
            f"the Hugging Face Hub is not asked (HF_HUB_OFFLINE=1); set HF_HUB_OFFLINE=0 to allow it")


def announce(line: str | None) -> None:
    """The line once per launch: by the first process only under torchrun or accelerate launch."""
    if line and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
