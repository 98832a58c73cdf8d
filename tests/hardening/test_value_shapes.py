"""Issue 28, class 1: a config value of the wrong shape is one line naming the key, on every command that reads a
config, for every key of every config.

The wrong values are generated from each field's type (`wrong_values`): a list holding an allowed value for a key that
takes one, a mapping, a value of another type, a choice in the wrong case. Each goes in as a `key=value` override
and as a YAML file, to every command that reads that config, with output_dir an existing folder holding a file: the
command exits 2 with one line that starts with the key, before any work, and the folder is unchanged.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from gpt4all_training.config.fields import unwrap_optional
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig
from gpt4all_training.errors import UserError

from .entry_points import clean_failure, snapshot

# The commands that read each config. `check` reports a config it cannot load as one FAIL line (exit 1).
COMMANDS = {TrainConfig: ("train", "data", "plan"), InferenceConfig: ("inference",), GenerateConfig: ("generate",),
            TokenizerConfig: ("tokenizer",)}
REQUIRED = {"model_name": "m", "dataset_path": "d"}


def wrong_values(tp: Any) -> list[Any]:
    """Values that are not of type `tp` (Optional or not), whatever YAML makes of them."""
    base, _ = unwrap_optional(tp)
    if base is bool:
        return [[True], "maybe", 1, {"a": 1}]
    if base is int:
        return [[1], "many", 1.5, True, {"a": 1}]
    if base is float:
        return [[0.5], "fast", True, {"a": 1}]
    if base is str:
        return [["x"], {"a": 1}, True]
    if base is dict:
        return [["a"], "text", 1]
    if typing.get_origin(base) is Literal:
        first = typing.get_args(base)[0]
        return [[first], {first: 1}, first.upper(), 1]
    if typing.get_origin(base) is list:
        inner = typing.get_args(base)[0]
        wrong = [{"a": 1}, [["a"]], 1, True]
        return wrong + ([["not-a-choice"]] if typing.get_origin(inner) is Literal else [])
    raise AssertionError(f"no wrong values for {tp}: add them, so the new type is tried too")


def cases() -> list[tuple[type, str, Any, str, int]]:
    """(config, key, wrong value, command, route) for every wrong value of every key of every config; the commands
    of a config and the two routes (0: YAML file, 1: override) take turns, so each pairing meets every kind of
    value."""
    out = []
    for cls, commands in COMMANDS.items():
        hints = typing.get_type_hints(cls)
        values = [(f.name, value) for f in dataclasses.fields(cls) for value in wrong_values(hints[f.name])]
        out += [(cls, key, value, commands[i % len(commands)], i % 2) for i, (key, value) in enumerate(values)]
    return out


CASES = cases()


def flow(value: Any) -> str:
    """`value` as one line of YAML, the way a user types it after `key=`."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def required(cls: type, key: str, output_dir: Path) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in REQUIRED.items() if k in names and k != key}
    return {**values, **({"output_dir": str(output_dir)} if "output_dir" in names and key != "output_dir" else {})}


@pytest.mark.parametrize("cls, key, value, command, route", CASES,
                         ids=[f"{command}-{key}-{flow(value)}-{('yaml', 'override')[route]}"
                              for cls, key, value, command, route in CASES])
def test_a_value_of_the_wrong_shape_is_one_line_naming_the_key_on_every_command(tmp_path, capsys, cls, key, value,
                                                                                command, route):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "kept.txt").write_text("the user's")
    given = required(cls, key, output_dir)
    config, base = tmp_path / "c.yaml", tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({**given, key: value}))
    base.write_text(yaml.safe_dump(given))
    before = snapshot(tmp_path)
    refusals = []
    for path, overrides in ((config, []), (base, [f"{key}={flow(value)}"])):
        with pytest.raises(UserError) as refused:
            load_config(path, overrides, cls=cls)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and refusals[0].startswith(f"{key}: ")
    argv = ["--config", str(config)] if route == 0 else ["--config", str(base), f"{key}={flow(value)}"]
    assert clean_failure(capsys, [command, *argv]) == f"error: {refusals[0]}"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("key, value", [("lr_schedule", "gpt3"), ("nan_policy", "skip"), ("train_turns", "last"),
                                        ("dtype", "bfloat16"), ("objective", "dpo"), ("prompt_template", "chat"),
                                        ("resume", "auto")])
def test_a_list_of_one_allowed_value_is_refused_not_read_as_the_default(key, value, capsys):
    """The sweep's cases: `lr_schedule=[gpt3]` trained with cosine; dtype, objective, prompt_template were
    tracebacks; `resume=[auto]` started afresh and set the old checkpoint aside."""
    with pytest.raises(UserError) as refused:
        load_config(None, ["model_name=m", "dataset_path=d", f"{key}=[{value}]"])
    assert str(refused.value).startswith(f"{key}: takes one value, not a list; must be ")
    assert str(refused.value).endswith(f", got [{value!r}]")
    assert getattr(load_config(None, ["model_name=m", "dataset_path=d", f"{key}={value}", "anneal_steps=10"]),
                   key) == value


def test_a_config_built_in_python_is_typed_as_a_loaded_one():
    """validate() checks every field's type, so a caller that builds a config in code meets the same line."""
    from gpt4all_training.config.blocks import validate

    with pytest.raises(UserError) as refused:
        validate(TrainConfig(model_name="m", dataset_path="d", lr_schedule=["gpt3"]))
    assert str(refused.value) == "lr_schedule: takes one value, not a list; must be 'cosine' or 'gpt3', got ['gpt3']"
    config = validate(TrainConfig(model_name="m", dataset_path="d", output_dir=Path("runs/a"), lr="5e-5"))
    assert config.output_dir == "runs/a" and config.lr == 5e-5


@pytest.mark.parametrize("theirs, ours", [("learning_rate", "lr"), ("per_device_train_batch_size", "batch_size"),
                                          ("num_train_epochs", "num_epochs"), ("max_seq_length", "max_length"),
                                          ("micro_batch_size", "batch_size"), ("sequence_len", "max_length"),
                                          ("bf16", "dtype"), ("lr_scheduler_type", "lr_schedule"),
                                          ("hub_model_id", "save_name"), ("base_model", "model_name")])
def test_the_names_trl_transformers_and_axolotl_use_point_to_ours(capsys, theirs, ours):
    line = clean_failure(capsys, ["data", "--config", "configs/train/finetune_tiny.yaml", f"{theirs}=1"])
    assert line.startswith(f"error: {theirs}: unknown key in the command-line overrides; did you mean {ours!r}? (")


def test_a_foreign_name_whose_setting_this_config_lacks_gets_no_wrong_hint():
    with pytest.raises(UserError) as refused:
        load_config(None, ["model_name=m", "learning_rate=1"], cls=GenerateConfig)
    assert str(refused.value) == "learning_rate: unknown key in the command-line overrides"


def test_check_reports_a_wrong_shape_as_one_failed_check(tmp_path, capsys):
    """`check` is a list of checks: a config it cannot read is its one FAIL line, and it exits 1 as for any."""
    from gpt4all_training.cli.main import main

    config = tmp_path / "c.yaml"
    config.write_text("model_name: m\ndataset_path: d\nlr_schedule: [gpt3]\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--config", str(config)])
    out = capsys.readouterr()
    assert exit_info.value.code == 1 and "Traceback" not in out.err
    assert [line for line in out.out.splitlines() if line.startswith("FAIL")] == [
        "FAIL  config: lr_schedule: takes one value, not a list; must be 'cosine' or 'gpt3', got ['gpt3']"]
