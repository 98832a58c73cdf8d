"""The run folder: what a training run writes into its output_dir, by name, and the paths to each. The one place these
names are spelled (tests/test_owners.py checks it); every package that writes or reads a run folder asks here.

    output_dir/
      step_N/                 the checkpoint after optimiser step N (training/checkpoint.py says what it holds):
        model/                  the full model or the adapter
        state.json              the step, the sampler's state, the run's id
        config.yaml             the run's config, redacted
        optimizer.pt, scheduler.pt, scaler.pt, data_state.pt, rng/, objective/, and the backend's engine state
        COMPLETE                written last (files.py)
      step_N.tmp/             a checkpoint being written; never loaded, removed by rotation
      step_N.set-aside-K/     a checkpoint a run had to move out of its way; nothing loads or deletes it
      final/                  the trained model, its tokenizer and config.yaml, COMPLETE; final.tmp/ while written
        merged/                 with merge_lora: the adapter merged into its base
      run_id                  the id of the run last started here
      metrics.jsonl, report.html, tensorboard/, wandb/, wandb_run_id   what the trackers record
      eval/                   benchmark scores taken after training
      tokenized/              the tokenized-data cache, when cache_dir is unset (data/cache.py)
      set-aside-K/            what resume=never moved out of a new run's way
      train.log, studio.json, studio_exit.json   the studio's: the run's output, how it started, how it ended

The completion marker's name belongs to files.py, which writes it into every folder it completes.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_PREFIX = "step_"
BUILDING_SUFFIX = ".tmp"  # a step_N/ or final/ being written, renamed into place once complete
SET_ASIDE = "set-aside-"
STEP_FOLDER = re.compile(rf"^{STEP_PREFIX}(\d+)$")
BUILDING_STEP_FOLDER = re.compile(rf"^{STEP_PREFIX}(\d+){re.escape(BUILDING_SUFFIX)}$")
SET_ASIDE_FOLDER = re.compile(rf"^{SET_ASIDE}(\d+)$")

FINAL_DIR = "final"
MERGED_DIR = "merged"  # in final/
RUN_ID_FILE = "run_id"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.html"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # made by wandb itself, in the folder it is given
WANDB_ID_FILE = "wandb_run_id"
EVAL_DIR = "eval"
TOKENIZED_DIR = "tokenized"  # the tokenized-data cache, when cache_dir is unset

# In a checkpoint (CONFIG_FILE in final/ too).
CONFIG_FILE = "config.yaml"
MODEL_DIR = "model"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
DATA_STATE_FILE = "data_state.pt"
RNG_DIR = "rng"
OBJECTIVE_DIR = "objective"

# The studio's, beside what the run writes.
LOG_FILE = "train.log"
RECORD_FILE = "studio.json"
EXIT_FILE = "studio_exit.json"

# What runs write, less the tokenized-data cache (keyed by content, so still valid for a new run) and the studio's
# files: what resume=never moves out of a new run's way. Checkpoints and final/ with their .tmp and set-aside forms.
RUN_OUTPUTS = re.compile("^(" + "|".join([
    rf"{STEP_PREFIX}\d+(\..+)?", rf"{FINAL_DIR}(\..+)?",
    *(rf"{re.escape(name)}(\.tmp)?" for name in (RUN_ID_FILE, METRICS_FILE)),
    *(re.escape(name) for name in (REPORT_FILE, TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE, EVAL_DIR)),
]) + ")$")


# ---------------------------------------------------------------- checkpoints

def step_folder(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{STEP_PREFIX}{step}"


def step_of(folder: Path) -> int | None:
    """The step of a checkpoint folder `step_N`; None for any other name."""
    match = STEP_FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def is_step_folder(folder: Path) -> bool:
    return step_of(folder) is not None


def numbered_folders(output_dir: str | Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := pattern.match(p.name)))


def step_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) for every `step_N` folder in output_dir, oldest first."""
    return numbered_folders(output_dir, STEP_FOLDER)


def building_step_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) for every `step_N.tmp` folder (a save in progress, or one a crash cut short), oldest first."""
    return numbered_folders(output_dir, BUILDING_STEP_FOLDER)


def building_folder(folder: Path) -> Path:
    """Where `folder` (a checkpoint or final/) is written before it is renamed into place."""
    return folder.with_name(folder.name + BUILDING_SUFFIX)


def set_aside_checkpoint(folder: Path, number: int) -> Path:
    """The name checkpoint `folder` takes when moved out of a run's way: one nothing loads or rotates."""
    return folder.with_name(f"{folder.name}.{SET_ASIDE}{number}")


# ---------------------------------------------------------------- the rest of the run folder

def set_aside_folders(output_dir: Path) -> list[tuple[int, Path]]:
    """(K, folder) for every `set-aside-K` folder resume=never made in output_dir."""
    return numbered_folders(output_dir, SET_ASIDE_FOLDER)


def set_aside_folder(output_dir: Path, number: int) -> Path:
    return output_dir / f"{SET_ASIDE}{number}"


def final_folder(output_dir: str | Path) -> Path:
    return Path(output_dir) / FINAL_DIR


def merged_folder(output_dir: str | Path) -> Path:
    return final_folder(output_dir) / MERGED_DIR


def is_final_folder(folder: Path) -> bool:
    return folder.name == FINAL_DIR


def is_merged_folder(folder: Path) -> bool:
    return folder.name == MERGED_DIR and is_final_folder(folder.parent)


def run_of(model: Path) -> Path | None:
    """The training output_dir above a `step_N/`, `final/` or `final/merged/` folder; None for any other path."""
    if is_merged_folder(model):
        return model.parent.parent
    if is_final_folder(model) or is_step_folder(model):
        return model.parent
    return None
