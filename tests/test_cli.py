"""The `gpt4all-training` command and the top-level scripts take the same arguments; the pins agree everywhere."""

from __future__ import annotations

import dataclasses
import os
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


def test_a_command_goes_offline_only_when_everything_it_names_is_local(tiny_model_dir):
    from gpt4all_training.cli.offline import named_sources

    def names(*argv: str):
        return named_sources(list(argv))

    assert names("serve", "--model", "smollm2") == ["smollm2"]
    assert names("serve", "--model", str(tiny_model_dir)) == [str(tiny_model_dir)]
    assert names("serve", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a Hub id
    assert names("train", "--config", "configs/train/finetune_tiny.yaml", "dataset_path=someone/dataset") is None
    assert names("export", "--from", str(tiny_model_dir), "--base", "EleutherAI/gpt-j-6B") is None
    assert names("eval", "--model", "smollm2", "--tasks", "hellaswag") is None  # the harness downloads its data
    assert names("eval", "--model", "smollm2", "--tasks", "gpt4all_offline", "--include-path", "configs/eval") == [
        "smollm2"]
    assert names("train", "--config", "configs/train/pretrain_tiny.yaml") == ["./tokenizers/tiny", "./data/clean",
                                                                            "gptj"]  # a model type
    assert names("clean", "raw.jsonl", "--output-dir", "data/clean") == []  # names no model: nothing to decide


@pytest.mark.integration
def test_offline_is_set_before_the_hub_libraries_load_and_said_once(tiny_model_dir):
    """Run without HF_HUB_OFFLINE, a command that names only local things sets it before huggingface_hub,
    transformers and datasets are imported (they read it once, then), and says so in one line; a variable the user
    set is left alone, and nothing is said."""
    report = ("import atexit, sys\n"
              "def report():\n"
              "    import datasets, huggingface_hub.constants as hub, transformers.utils.hub as th\n"
              "    print('offline:', hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, th.is_offline_mode(),"
              " file=sys.stderr)\n"
              "atexit.register(report)\n"
              "from gpt4all_training.cli.main import main\n"
              "main(sys.argv[1:])\n")
    argv = ["generate", "--config", "configs/generate/tiny.yaml", f"model_name={tiny_model_dir}", "max_new_tokens=2",
            "--prompt", "Hi"]
    environment = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                    "TRANSFORMERS_OFFLINE")}
    for preset, said in ((None, True), ("0", False)):
        env = {**environment, **({"HF_HUB_OFFLINE": preset} if preset else {})}
        result = subprocess.run([PYTHON, "-c", report, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if line.startswith("offline:")]
        if said:
            assert lines == [f"offline: everything this command names is on this machine ({tiny_model_dir}), so the "
                             f"Hugging Face Hub is not asked (HF_HUB_OFFLINE=1); set HF_HUB_OFFLINE=0 to allow it",
                             "offline: True True True"]
        else:
            assert lines == ["offline: False False False"]
