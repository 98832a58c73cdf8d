"""Issue 28, class 6: a credential pasted into any string field never reaches a line the program prints or logs, nor
the run's config snapshot: the environment's secrets and token-shaped text alike are shown as ***.

The property test pastes both kinds into every string field of every config (read from the dataclass types) and
runs the commands that read that config; the end-to-end test trains with them in every field a run accepts and
reads every file it wrote.
"""

from __future__ import annotations

import dataclasses
import secrets
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.launch import explain

from gpt4all_training.cli.main import main
from gpt4all_training.config.fields import unwrap_optional
from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig
from gpt4all_training.config.secrets import REDACTED, scrub
from gpt4all_training.tracking.hub import push_folder

from .harness import run_train

# A Hugging Face token that is in no environment variable (found by its shape), and an environment secret.
TOKEN = "hf_" + "Q7" * 17
KEY = "k3y-" + "9" * 16
# The commands that read each config (train's own output is the end-to-end test's: it reads the same config as
# data and plan, and its eval_tasks check alone would index the harness's tasks for 20 s a case).
COMMANDS = {TrainConfig: ("data", "plan"), InferenceConfig: ("inference",), GenerateConfig: ("generate",),
            TokenizerConfig: ("tokenizer",)}


@pytest.mark.parametrize("text, hidden", [
    (f"org/{TOKEN}", "org/***"), ("sk-proj-" + "a1" * 12, "***"), ("ghp_" + "Z" * 36, "***"),
    ("github_pat_" + "1" * 40, "***"), ("glpat-" + "x" * 20, "***"), ("xoxb-1234-5678-abcdef", "***"),
    ("AKIAIOSFODNN7EXAMPLE", "***"),
    # not credentials: a commit hash, a path, words that start like tokens
    ("f75634e" + "0" * 33, "f75634e" + "0" * 33), ("ckpts/hf_hub/sk-learn", "ckpts/hf_hub/sk-learn"),
    ("hf_transfer", "hf_transfer"), ("task-sk-1", "task-sk-1"),
])
def test_token_shaped_text_is_hidden_and_nothing_else(text, hidden):
    assert scrub(text, []) == hidden


def string_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        base, _ = unwrap_optional(hints[f.name])
        if base is str or typing.get_origin(base) is list and typing.get_args(base)[0] is str:
            out.append(f.name)
    return out


CASES = [(cls, name, command) for cls, commands in COMMANDS.items() for name in string_fields(cls)
         for command in commands]


def pasted(cls: type, name: str, tmp_path: Path) -> Any:
    """Both secrets inside the field's value, as a user might paste them."""
    base, _ = unwrap_optional(typing.get_type_hints(cls)[name])
    text = f"{tmp_path}/{TOKEN}/{KEY}" if name in ("output_dir", "cache_dir") else f"x-{TOKEN}-{KEY}"
    return [text] if typing.get_origin(base) is list else text


@pytest.mark.parametrize("cls, name, command", CASES, ids=[f"{command}-{name}" for _, name, command in CASES])
def test_a_secret_in_any_string_field_reaches_no_line(tmp_path, capsys, monkeypatch, cls, name, command):
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    values = {"model_name": str(tmp_path / "no-model"), "dataset_path": str(tmp_path / "no-data"),
              "output_dir": str(tmp_path / "out")}
    values = {k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls)}}
    values[name] = pasted(cls, name, tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(values))
    with pytest.raises(SystemExit):
        main([command, "--config", str(config)])
    out, err = capsys.readouterr()
    assert TOKEN not in out + err and KEY not in out + err
    assert "Traceback" not in err


def test_the_hub_push_warning_hides_a_token_pasted_into_save_name(tmp_path, capsys, monkeypatch):
    """The sweep's case: the offline warning printed the repo id as given. push_folder hides secrets itself, for
    callers of train() outside the CLI too."""
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    assert push_folder(tmp_path, f"someone/{TOKEN}-{KEY}") is None  # the tests run offline
    err = capsys.readouterr().err
    assert err.startswith("warning: push_to_hub: not pushing") and TOKEN not in err and KEY not in err
    assert f"someone/{REDACTED}-{REDACTED}" in err


def test_everything_a_command_prints_is_scrubbed(tmp_path, capsys, monkeypatch):
    """clean prints each input's name: a file named with secrets is printed with *** in their place."""
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    raw = tmp_path / f"raw-{TOKEN}-{KEY}.jsonl"
    raw.write_text('{"prompt": "a question", "response": "an answer"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["clean", str(raw), "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0 and f"{tmp_path}/raw-***-***.jsonl: lines 1, read 1, kept 1" in out
    assert TOKEN not in out + err and KEY not in out + err


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_with_secrets_in_every_field_it_takes_prints_and_snapshots_none(hard_config, hard_data, tiny_model_dir,
                                                                               tmp_path):
    """Secrets in the model's, data's, output's and cache's paths, the Hub repo (pushed to at the end: offline, it
    warns), the wandb names: nothing the run prints, and no file it or the libraries it calls write under output_dir
    and cache_dir, holds either (the config snapshots hold ***)."""
    key = secrets.token_hex(12)
    token = "hf_" + secrets.token_hex(17)
    model, data = tmp_path / f"model-{key}", tmp_path / f"data-{token}"
    model.symlink_to(tiny_model_dir, target_is_directory=True)
    data.symlink_to(hard_data, target_is_directory=True)
    out = tmp_path / f"run-{key}"
    result = run_train(hard_config, out, f"model_name={model}", f"dataset_path={data}", "save_every=2",
                       f"cache_dir={tmp_path / f'cache-{token}'}", "push_to_hub=true", f"save_name=someone/{token}",
                       f"wandb_project_name=project-{key}", f"wandb_entity=team-{token}",
                       env={"MY_SERVICE_KEY": key, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, explain(result)
    printed = result.stdout + result.stderr
    assert token not in printed and key not in printed
    assert f"push_to_hub: not pushing {tmp_path}/run-***/final to someone/***" in printed
    cache = tmp_path / f"cache-{token}"
    holding = [str(p) for folder in (out, cache) for p in folder.rglob("*") if p.is_file()
               and (token.encode() in p.read_bytes() or key.encode() in p.read_bytes())]
    assert holding == [] and any(cache.rglob("COMPLETE"))
    saved = yaml.safe_load((out / "step_2" / "config.yaml").read_text())
    assert saved["save_name"] == "someone/***" and saved["model_name"] == f"{tmp_path}/model-***"
    assert saved["cache_dir"] == f"{tmp_path}/cache-***" and saved["wandb_entity"] == "team-***"
