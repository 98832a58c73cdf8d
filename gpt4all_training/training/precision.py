"""`dtype: auto` resolved once per run, before the backend is built: the dtype of the run a checkpoint continues, or
this machine's native one (backends/precision.py). The resolved config is what the run saves (config.yaml of every
checkpoint), so a resumed run keeps the dtype it started with, on whatever machine it continues."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Callable

import yaml

from gpt4all_training.backends.precision import native_dtype
from gpt4all_training.config.blocks import Dtype
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.run_folder import CONFIG_FILE, final_folder, step_folders
from gpt4all_training.training.checkpoint import read_run_id, saved_run_id

CONCRETE_DTYPES = typing.get_args(Dtype)


def main_process_print(line: str) -> None:
    """print on the launch's first process only (the backend that says which one is built after this)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def resolve_dtype(config: TrainConfig, log: Callable[[str], Any] = main_process_print) -> TrainConfig:
    """`config` with dtype auto replaced by what it stands for, said in one line; any other dtype as it is."""
    if config.dtype != "auto":
        return config
    resumed = resumed_dtype(config)
    dtype, why = (resumed, "what the run this one continues resolved") if resumed else native_dtype()
    log(f"dtype: auto is {dtype} ({why})")
    return dataclasses.replace(config, dtype=typing.cast(Dtype, dtype))


def resumed_dtype(config: TrainConfig) -> str | None:
    """The dtype saved with the checkpoint this run would continue (the newest of the run last started in
    output_dir, or checkpoint=PATH), read without verifying it: resume_point verifies the one it continues next,
    and a run's checkpoints all hold the dtype it resolved. Without one, final/'s: resume_point compares the config
    with a finished run's, and the same command on another machine is the same run. None when the run starts
    fresh."""
    if config.resume == "never":
        return None
    if config.checkpoint and config.checkpoint != "auto":
        folder: Path | None = Path(config.checkpoint)
    else:
        run_id = read_run_id(config.output_dir)
        if run_id is None and "auto" not in (config.resume, config.checkpoint):
            return None
        folders = [f for _, f in step_folders(config.output_dir) if run_id is None or saved_run_id(f) == run_id]
        final = final_folder(config.output_dir)
        folder = folders[-1] if folders else final if final.is_dir() else None
    try:
        saved = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8")) if folder else None
    except (OSError, yaml.YAMLError):
        return None  # resume_point says what is wrong with this checkpoint
    dtype = saved.get("dtype") if isinstance(saved, dict) else None
    return dtype if dtype in CONCRETE_DTYPES else None
