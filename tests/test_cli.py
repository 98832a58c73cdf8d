"""The `gpt4all-training` command and the top-level scripts take the same arguments; the pins agree everywhere."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support.paths import PYTHON, REPO

from gpt4all_training.cli.main import COMMANDS, main
from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig

COMMAND = str(Path(PYTHON).parent / "gpt4all-training")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_help_lists_every_subcommand():
    result = run(COMMAND, "--help")
    assert (result.returncode, result.stderr) == (0, "")
    listed = re.search(r"\{([a-z_,]+)\}", result.stdout).group(1).split(",")
    assert listed == list(COMMANDS)
    assert {"clean", "data", "train"} <= set(listed)
    for name, (_, help_text) in COMMANDS.items():
        assert " ".join(help_text.split()[:3]) in " ".join(result.stdout.split())  # each has its one-line help


@pytest.mark.integration
def test_clean_script_and_subcommand_take_the_same_arguments():
    script, subcommand = run(PYTHON, "clean.py", "--help"), run(COMMAND, "clean", "--help")
    assert script.returncode == subcommand.returncode == 0
    assert script.stdout == subcommand.stdout
    for option in ("--output-dir", "--drop-ai-disclaimers", "--drop-refusals", "--min-response-chars", "inputs"):
        assert option in script.stdout


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[name.lower()] = version
    return found


def test_env_yaml_pins_the_same_versions_as_requirements():
    requirements = pins((REPO / "requirements.txt").read_text().splitlines()
                        + (REPO / "requirements-dev.txt").read_text().splitlines())
    env = yaml.safe_load((REPO / "env.yaml").read_text())
    pip_section = next(item["pip"] for item in env["dependencies"] if isinstance(item, dict))
    assert pins(pip_section) == requirements
    assert "torch" in requirements and len(requirements) >= 15
    assert "python=3.11" in env["dependencies"]


def assert_help_lists_the_keys(text: str, cls: type) -> None:
    """Every key, once, with its default and its whole doc; under its block's title, in the blocks' order."""
    flat = " ".join(text.split())
    for field in dataclasses.fields(cls):
        assert len(re.findall(rf"^  {field.name}: ", text, flags=re.MULTILINE)) == 1, field.name
        assert " ".join(field.metadata["doc"].split()) in flat, field.name
    titles = [title for title, _ in cls.groups()]
    assert [text.index(f"\n{title}\n") for title in titles] == sorted(text.index(f"\n{t}\n") for t in titles)


def test_train_help_shows_every_config_key_with_its_doc_and_default():
    result = run(COMMAND, "train", "--help")
    assert (result.returncode, result.stderr) == (0, "")
    assert_help_lists_the_keys(result.stdout, TrainConfig)
    for line in ("  model_name: (required)", "  lr: 2.0e-05", "  report_to: [jsonl]  [wandb | tensorboard | jsonl]", "  max_steps: (unset)",
                 "  lr_schedule: cosine  [cosine | gpt3]", "  lora: false"):
        assert f"\n{line}\n" in result.stdout, line
    assert "\nschedule: the learning rate at each optimizer step, and how many steps there are.\n  lr: " in \
        result.stdout


@pytest.mark.parametrize("subcommand, cls", [
    ("inference", InferenceConfig), ("generate", GenerateConfig), ("tokenizer", TokenizerConfig),
    ("data", TrainConfig), ("plan", TrainConfig), ("check", TrainConfig),
])
def test_every_config_subcommand_help_shows_its_keys(capsys, subcommand, cls):
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--help"])
    captured = capsys.readouterr()
    assert (exit_info.value.code, captured.err) == (0, "")
    assert_help_lists_the_keys(captured.out, cls)
    assert "key=value" in captured.out and "--config" in captured.out
