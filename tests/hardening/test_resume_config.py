"""Resuming under a config that trains something else is refused in one line naming the keys, unless
resume_allow_changes lists them (and then the optimizer and the schedule follow the new values, and the log says what
that does to the schedule); keys that only change logging, evaluation, saving or the launch may change freely. The
data is compared by the SHA-256 of its records, so a moved dataset resumes and another of the same size does not."""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest
import torch
from support.files import write_jsonl
from support.launch import explain
from support.outputs import assert_bitwise_equal_weights, exact_rows, metrics

from gpt4all_training import cli
from gpt4all_training.config.fields import choices, unwrap_optional
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.config.secrets import redact
from gpt4all_training.data.records import load_records, records_fingerprint
from gpt4all_training.errors import UserError
from gpt4all_training.model.parameters import param_groups
from gpt4all_training.training.resume_config import (FREE_KEYS, check_config_changes, config_changes,
                                                     hyperparameters, restore_hyperparameters)
from gpt4all_training.training.schedule import build_scheduler, learning_rate

from .harness import error_lines, run_train

HINTS = typing.get_type_hints(TrainConfig)


def changed_value(config: TrainConfig, name: str):
    """A value of field `name` other than config's, of the field's type (a choice picks another allowed one)."""
    value, hint = getattr(config, name), HINTS[name]
    base, _ = unwrap_optional(hint)
    allowed = choices(hint)
    if allowed and typing.get_origin(base) is list:
        return [a for a in allowed if a not in (value or [])][:1] or []
    if allowed:
        return next(a for a in allowed if a != value) if value is not None else allowed[0]
    if base is bool:
        return not value
    if base in (int, float):
        return (value or 0) + 1
    if base is str:
        return (value or "") + "-other"
    if base is dict:
        return {"n_layer": 3}
    return [*(value or []), "q_proj"]


@pytest.fixture(scope="module")
def base(hard_config) -> TrainConfig:
    return load_config(hard_config)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig)])
def test_every_key_is_compared_unless_it_only_changes_how_the_run_is_watched(base, name):
    """Each config key changed alone: refused (named, with both values) unless it is one of FREE_KEYS."""
    saved = redact(base.to_dict())
    changed = dataclasses.replace(base, **{name: changed_value(base, name)})
    changes = config_changes(saved, changed, {}, None)
    if name in FREE_KEYS:
        assert name not in changes
    else:
        assert changes == {name: (saved[name], getattr(changed, name))}


def test_the_data_is_compared_by_its_content_not_its_path(base):
    saved = redact(base.to_dict())
    moved = dataclasses.replace(base, dataset_path="/elsewhere/data", revision="main")
    assert config_changes(saved, moved, {"data_fingerprint": "ab" * 32}, "ab" * 32) == {}
    assert config_changes(saved, base, {"data_fingerprint": "ab" * 32}, "cd" * 32) == {
        "dataset_path": ("content sha256 " + "ab" * 6, "cd" * 6)}
    # A checkpoint from before data fingerprints (or a stream) falls back to the path.
    assert config_changes(saved, moved, {}, "cd" * 32) == {"dataset_path": (base.dataset_path, "/elsewhere/data"),
                                                          "revision": (None, "main")}


def test_a_refusal_names_every_changed_key_in_one_line(base, tmp_path):
    saved = redact(base.to_dict())
    changed = dataclasses.replace(base, lr=2e-3, weight_decay=0.1, max_length=32, log_every=5)
    with pytest.raises(UserError) as refused:
        check_config_changes(tmp_path, saved, changed, {"step": 4}, None, 10, print)
    assert str(refused.value) == (
        f"checkpoint {tmp_path}: this config changes what the run trains: max_length (64 -> 32), lr (0.001 -> "
        f"0.002), weight_decay (0.0 -> 0.1); resume with the checkpoint's values, or list the keys in "
        f"resume_allow_changes to change them on purpose (or start a new output_dir)")
    allowed = dataclasses.replace(changed, resume_allow_changes=["max_length", "lr", "weight_decay"])
    said = []
    assert check_config_changes(tmp_path, saved, allowed, {"step": 4, "steps_per_epoch": 10}, None, 10,
                                said.append) == ["max_length", "lr", "weight_decay"]
    assert said[0] == ("resume_allow_changes: resuming with max_length (64 -> 32), lr (0.001 -> 0.002), "
                       "weight_decay (0.0 -> 0.1)")
    before, after = learning_rate(4, base, 6), learning_rate(4, allowed, 6)
    assert said[1] == (f"the schedule: the run now ends after step 6 (was 6); step 5 trains at lr {after:.4g} (it "
                       f"would have been {before:.4g}), and the lr follows the new schedule from there")


def test_allowed_changes_reach_the_optimizer_and_the_schedule(base):
    """Loading a checkpoint puts back the saved weight decay, base lr and this step's lr; an allowed change must not
    be undone by it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))

    def optimizer_and_scheduler(config, total):
        optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr)
        return optimizer, build_scheduler(optimizer, config, total)

    old_optimizer, old_scheduler = optimizer_and_scheduler(base, 6)
    for _ in range(4):
        old_optimizer.step()
        old_scheduler.step()
    new = dataclasses.replace(base, lr=2e-3, weight_decay=0.1, max_steps=8)
    optimizer, scheduler = optimizer_and_scheduler(new, 8)
    fresh = hyperparameters(scheduler)
    optimizer.load_state_dict(old_optimizer.state_dict())
    scheduler.load_state_dict(old_scheduler.state_dict())
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # what loading alone leaves: the old run's values
    assert scheduler.get_last_lr()[0] == learning_rate(4, base, 6)
    restore_hyperparameters(scheduler, *fresh)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [learning_rate(4, new, 8)] * 2
    assert scheduler.get_last_lr() == [learning_rate(4, new, 8)] * 2
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(learning_rate(5, new, 8), rel=1e-12)


# ---------------------------------------------------------------- through train.py

@pytest.fixture(scope="module")
def saved_run(checkpointed_run) -> Path:
    """The hardening run with checkpoints at steps 2 and 4; refused resumes leave it as it was."""
    return checkpointed_run


@pytest.fixture(scope="module")
def other_data(dolly_rows, tmp_path_factory) -> Path:
    """40 other records: the same size as the run's data, other content."""
    folder = tmp_path_factory.mktemp("other-data")
    write_jsonl(folder / "a_clean.jsonl", [{**row, "response": row["response"] + " Indeed."} for row in dolly_rows])
    return folder


# dtype is refused through train.py below: this process's accelerate state cannot change its precision.
CHANGES = ["lr=2e-3", "weight_decay=0.1", "max_length=32", "warmup_steps=2", "max_steps=8", "max_grad_norm=0.5",
           "min_lr=0", "seed=4", "val_fraction=0.1", "lora=true"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("override", CHANGES)
def test_resuming_with_a_key_that_changes_the_result_is_one_line(hard_config, saved_run, override, capsys):
    key, value = override.split("=")
    saved = load_config(hard_config)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(hard_config), f"output_dir={saved_run}", "resume=auto", override])
    assert exit_info.value.code == 2
    new = getattr(load_config(hard_config, [override]), key)
    assert error_lines(capsys.readouterr().err) == [
        f"error: checkpoint {saved_run / 'step_4'}: this config changes what the run trains: {key} "
        f"({getattr(saved, key)!r} -> {new!r}); resume with the checkpoint's values, or list the keys in "
        f"resume_allow_changes to change them on purpose (or start a new output_dir)"]


@pytest.mark.integration
@pytest.mark.slow
def test_resuming_with_another_dtype_is_one_line_from_train_py(hard_config, saved_run):
    result = run_train(hard_config, saved_run, "resume=auto", "dtype=bfloat16")
    assert result.returncode == 2, explain(result)
    assert error_lines(result.stderr) == [
        f"error: checkpoint {saved_run / 'step_4'}: this config changes what the run trains: dtype ('float32' -> "
        f"'bfloat16'); resume with the checkpoint's values, or list the keys in resume_allow_changes to change them "
        f"on purpose (or start a new output_dir)"]
    assert "Traceback" not in result.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_resuming_on_other_data_of_the_same_size_is_refused_and_moved_data_is_not(hard_config, hard_data, saved_run,
                                                                                 other_data, tmp_path, capsys):
    ours = records_fingerprint(load_records(str(hard_data)))
    theirs = records_fingerprint(load_records(str(other_data)))
    assert len(load_records(str(other_data))) == len(load_records(str(hard_data))) and ours != theirs
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(hard_config), f"output_dir={saved_run}", "resume=auto",
                  f"dataset_path={other_data}"])
    assert exit_info.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: checkpoint {saved_run / 'step_4'}: this config changes what the run trains: dataset_path ('content "
        f"sha256 {ours[:12]}' -> '{theirs[:12]}'); resume with the checkpoint's values, or list the keys in "
        f"resume_allow_changes to change them on purpose (or start a new output_dir)"]
    assert json.loads((saved_run / "step_4" / "state.json").read_text())["data_fingerprint"] == ours

    moved = shutil.copytree(hard_data, tmp_path / "moved-data")
    out = shutil.copytree(saved_run, tmp_path / "run")
    resumed = run_train(hard_config, out, "resume=auto", f"dataset_path={moved}")
    assert resumed.returncode == 0, explain(resumed)
    assert f"resumed from {out / 'step_4'} at step 4" in resumed.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_free_keys_change_and_the_run_ends_bitwise_where_it_would_have(hard_config, reference, saved_run, tmp_path):
    out = shutil.copytree(saved_run, tmp_path / "run")
    resumed = run_train(hard_config, out, "checkpoint=" + str(out / "step_2"), "log_every=2",
                        "save_every=1", "keep_last=3", "report_to=jsonl,tensorboard", "num_proc=2")
    assert resumed.returncode == 0, explain(resumed)
    assert "resume_allow_changes" not in resumed.stdout
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_an_allowed_max_steps_says_what_it_does_to_the_schedule_and_the_run_follows_it(hard_config, saved_run,
                                                                                       tmp_path):
    out = shutil.copytree(saved_run, tmp_path / "run")
    resumed = run_train(hard_config, out, "resume=auto", "max_steps=8", "resume_allow_changes=max_steps")
    assert resumed.returncode == 0, explain(resumed)
    old, new = load_config(hard_config), load_config(hard_config, ["max_steps=8"])
    assert "resume_allow_changes: resuming with max_steps (6 -> 8)" in resumed.stdout
    assert (f"the schedule: the run now ends after step 8 (was 6); step 5 trains at lr {learning_rate(4, new, 8):.4g} "
            f"(it would have been {learning_rate(4, old, 6):.4g}), and the lr follows the new schedule from there"
            ) in resumed.stdout
    rows = [row for row in metrics(out) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert [row["lr"] for row in rows[:4]] == [row["lr"] for row in exact_rows(saved_run)[:4]]
    assert [row["lr"] for row in rows[4:]] == pytest.approx([learning_rate(s, new, 8) for s in range(4, 8)],
                                                            rel=1e-12)
    assert rows[-1]["lr"] == pytest.approx(new.min_lr)  # the schedule reaches min_lr at the new end


def test_resume_allow_changes_takes_config_keys_only(hard_config):
    assert load_config(hard_config, ["resume_allow_changes=max_steps,lr"]).resume_allow_changes == ["max_steps", "lr"]
    with pytest.raises(UserError, match=r"^resume_allow_changes: must list config keys only, got \['max_step'\]$"):
        load_config(hard_config, ["resume_allow_changes=max_step"])

