"""Whether a checkpoint may be continued under this config: what it trains must be what the checkpoint's run trained.

A resumed run compares its config with the checkpoint's `config.yaml`. A key that changes the trained result (the
learning rate and its schedule, weight decay, clipping, max_length, dtype, the data, the model, LoRA, ...) must keep
the checkpoint's value, unless `resume_allow_changes` lists it; a key that only changes how the run is watched, saved
or launched (`FREE_KEYS`) may change freely. The data is compared by the SHA-256 of its content (state.json's
`data_fingerprint`), so a moved dataset resumes and another one of the same size does not. Keys the checkpoint's
config does not have (written before they existed) are not compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from gpt4all_training.config.blocks import Checkpoints, Schedule
from gpt4all_training.config.fields import shown
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.config.secrets import redact
from gpt4all_training.errors import UserError
from gpt4all_training.training.schedule import learning_rate, total_optimizer_steps

# Keys that change how the run is logged, evaluated, saved, published or launched, never the weights it trains.
# batch_size and gradient_accumulation_steps are here because the global batch they make (with the number of
# processes) is what decides the examples of a step, and the sampler's check refuses a different one; gradient
# checkpointing, compile and packing change speed and memory, not the update.
FREE_KEYS = frozenset({
    "log_every", "log_grads_every", "log_lr_every", "report_to", "wandb", "wandb_entity", "wandb_project_name",
    "eval_every", "eval_steps", "save_every", "keep_last", "keep_every", "output_dir", "cache_dir", "checkpoint",
    "resume", "resume_allow_changes", "push_to_hub", "save_name", "merge_lora", "merge_dtype", "nan_policy",
    "ddp_timeout_s", "num_proc", "batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "compile",
    "packing", "eval_tasks", "eval_tasks_limit", "eval_include_path", "eval_tasks_every",
})
# Where the data comes from: not compared when both runs know the data's content hash (a moved file is the same data).
DATA_KEYS = ("dataset_path", "revision")
# What a refused resume can always do instead.
NEW_OUTPUT_DIR = "start a new output_dir"
# Keys that shape the learning rate at each step; changing one is described by what it does to the schedule.
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "lr_schedule", "anneal_steps", "end_lr", "num_epochs", "max_steps")


def config_changes(saved: dict[str, Any], config: TrainConfig, saved_state: dict[str, Any],
                   fingerprint: str | None, compare_data: bool = True) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint's value, this config's value)} for every key whose change alters what is trained; the
    data's content appears under `dataset_path` as its two hashes. `compare_data=False` leaves the data keys out
    (before the data is read, when its content will be compared)."""
    current = redact(config.to_dict())  # the checkpoint's config.yaml was written redacted
    saved_fingerprint = saved_state.get("data_fingerprint")
    by_content = bool(fingerprint and saved_fingerprint)
    skip_data = by_content or not compare_data
    changes = {key: (saved[key], value) for key, value in current.items()
               if key in saved and saved[key] != value and key not in FREE_KEYS
               and not (skip_data and key in DATA_KEYS)}
    if fingerprint and saved_fingerprint and fingerprint != saved_fingerprint:  # by_content
        changes["dataset_path"] = (f"content sha256 {saved_fingerprint[:12]}", f"{fingerprint[:12]}")
    return changes


def described(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} ({shown(old)} -> {shown(new)})" for key, (old, new) in changes.items())


def refuse_changes(folder: Path, changes: dict[str, tuple[Any, Any]], config: Checkpoints,
                   alternative: str = NEW_OUTPUT_DIR) -> None:
    """One line naming every change `resume_allow_changes` does not list, with both values; `alternative` is what
    else the user can do."""
    refused = {key: change for key, change in changes.items() if key not in config.resume_allow_changes}
    if refused:
        raise UserError(f"checkpoint {folder}: this config changes what the run trains: {described(refused)}; resume "
                        f"with the checkpoint's values, or list the keys in resume_allow_changes to change them on "
                        f"purpose (or {alternative})")


def check_config_changes(folder: Path, saved: dict[str, Any], config: TrainConfig, saved_state: dict[str, Any],
                         fingerprint: str | None, steps_per_epoch: int, log: Callable[[str], Any],
                         alternative: str = NEW_OUTPUT_DIR) -> list[str]:
    """Refuse, in one line naming them, the changes from the checkpoint's config that `resume_allow_changes` does not
    list; say what the allowed ones do (to the schedule, for its keys). Returns the keys that changed on purpose."""
    changes = config_changes(saved, config, saved_state, fingerprint)
    refuse_changes(folder, changes, config, alternative)
    if changes:
        log(f"resume_allow_changes: resuming with {described(changes)}")
    if any(key in SCHEDULE_KEYS for key in changes):
        log(schedule_change(saved, config, saved_state, steps_per_epoch))
    return list(changes)


def schedule_change(saved: dict[str, Any], config: Schedule, saved_state: dict[str, Any], steps_per_epoch: int) -> str:
    """What the changed schedule keys do: where the run now ends, and the lr of the next step before and after."""
    before = dataclasses.replace(config, **{key: saved[key] for key in SCHEDULE_KEYS if key in saved})
    total_before = total_optimizer_steps(saved_state.get("steps_per_epoch", steps_per_epoch), before.num_epochs,
                                         before.max_steps)
    total_after = total_optimizer_steps(steps_per_epoch, config.num_epochs, config.max_steps)
    step = saved_state["step"]
    lr_before = learning_rate(step, before, total_before)
    lr_after = learning_rate(step, config, total_after)
    return (f"the schedule: the run now ends after step {total_after} (was {total_before}); step {step + 1} trains "
            f"at lr {lr_after:.4g} (it would have been {lr_before:.4g}), and the lr follows the new schedule from "
            f"there")


def restore_hyperparameters(scheduler, fresh_groups: list[dict[str, Any]], fresh_base_lrs: list[float]) -> None:
    """Put this config's weight decay and learning rate back after a checkpoint's optimizer and scheduler state
    replaced them, and set the lr of the next step from this config's schedule (loading restores the saved run's).
    Only for a resume whose config changed on purpose: otherwise the two are the same values."""
    optimizer = scheduler.optimizer
    for group, fresh in zip(optimizer.param_groups, fresh_groups):
        group.update(fresh)
    scheduler.base_lrs = list(fresh_base_lrs)
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step


def hyperparameters(scheduler) -> tuple[list[dict[str, Any]], list[float]]:
    """The optimizer's weight decay and initial lr per group, and the scheduler's base lrs: what this config set,
    taken before a checkpoint is loaded over them (restore_hyperparameters puts them back)."""
    groups = [{key: group[key] for key in ("weight_decay", "initial_lr") if key in group}
              for group in scheduler.optimizer.param_groups]
    return groups, list(scheduler.base_lrs)
