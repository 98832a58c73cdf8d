"""Issues 28 (class 6) and 40 (class 5): a credential pasted into any string field never reaches a line the program
prints or logs, nor the run's config snapshot, nor wandb's files: the environment's secrets and token-shaped text
alike are shown as ***, a token after any separator (`_ - . / =`) included.

The property test pastes both kinds into every string field of every config (read from the dataclass types), in the
config file or as an override, and runs the commands that read that config; the end-to-end test trains with them in
every field a run accepts, wandb recording, and reads every file it and wandb wrote.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.files import write_config
from support.launch import explain
from support.paths import PYTHON, REPO

from gpt4all_training.cli.main import main
from gpt4all_training.config.fields import unwrap_optional
from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig
from gpt4all_training.config.secrets import REDACTED, scrub, scrubbed_output, scrubbing_records
from gpt4all_training.tracking.hub import push_folder
from gpt4all_training.tracking.tracker import wandb_settings

from .harness import run_train

# A Hugging Face token that is in no environment variable (found by its shape), and an environment secret.
TOKEN = "hf_" + "Q7" * 17
KEY = "k3y-" + "9" * 16
# The commands that read each config (train's own output is the end-to-end test's: it reads the same config as
# data and plan, and its eval_tasks check alone would index the harness's tasks for 20 s a case).
SEPARATORS = "_-./="
COMMANDS = {TrainConfig: ("data", "plan"), InferenceConfig: ("inference",), GenerateConfig: ("generate",),
            TokenizerConfig: ("tokenizer",)}


# What may stand before a credential (the separators of paths and names, a space, a quote) and after it.
BEFORE = ["_", "-", ".", "/", "=", " ", ":", "'"]
AFTER = ["", ".yaml", "/step_2", "=1", " next", "_v2"]
# One credential of each shape (fixed, so the ids are stable), and whether `_` continues it.
SHAPES = {"huggingface": ("hf_" + "Ab9" * 11, False), "openai": ("sk-proj-" + "a1" * 12, True),
          "anthropic": ("sk-ant-" + "B_2-" * 6, True), "github": ("ghp_" + "Z9" * 18, False),
          "github_pat": ("github_pat_" + "1a" * 20, True), "gitlab": ("glpat-" + "x-7" * 7, True),
          "slack": ("xoxb-1234-5678-abcdef", False), "aws": ("AKIAIOSFODNN7EXAMPLE", False)}


@pytest.mark.parametrize("text, hidden", [
    (f"org/{TOKEN}", "org/***"), ("sk-proj-" + "a1" * 12, "***"), ("ghp_" + "Z" * 36, "***"),
    ("github_pat_" + "1" * 40, "***"), ("glpat-" + "x" * 20, "***"), ("xoxb-1234-5678-abcdef", "***"),
    ("AKIAIOSFODNN7EXAMPLE", "***"), (f"runs/sec_{TOKEN}/final", "runs/sec_***/final"),
    # not credentials: a commit hash, a path, words and keys that start like tokens, a token's prefix in a word
    ("f75634e" + "0" * 33, "f75634e" + "0" * 33), ("ckpts/hf_hub/sk-learn", "ckpts/hf_hub/sk-learn"),
    ("hf_transfer", "hf_transfer"), ("task-sk-1", "task-sk-1"), ("HF_HOME=/data/hf_home", "HF_HOME=/data/hf_home"),
    ("my_sk_learn_model", "my_sk_learn_model"), ("run_sk-learn", "run_sk-learn"),
    ("cache_hf_hub_download_dir", "cache_hf_hub_download_dir"), ("disk-" + "cache" * 5, "disk-" + "cache" * 5),
    ("use_ghp_tokens", "use_ghp_tokens"), ("x_AKIA_docs", "x_AKIA_docs"),
])
def test_token_shaped_text_is_hidden_and_nothing_else(text, hidden):
    assert scrub(text, []) == hidden


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("before", BEFORE, ids=repr)
def test_a_token_after_any_separator_is_hidden_and_one_inside_a_word_is_not(shape, before):
    """Every shape after every separator and at the start, with every ending: the token is *** and the text around
    it is kept (an ending that the token's own characters continue, `_v2` after an OpenAI key, goes with it). The
    same letters inside a word (`x` + token) are no token."""
    token, takes_underscore = SHAPES[shape]
    for after in AFTER:
        kept = "" if after.startswith("_") and takes_underscore else after
        assert scrub(f"run{before}{token}{after}", []) == f"run{before}***{kept}"
        assert scrub(f"{token}{after}", []) == f"***{kept}"
    assert scrub(f"run{before}x{token}", []) == f"run{before}x{token}"


def string_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        base, _ = unwrap_optional(hints[f.name])
        if base is str or typing.get_origin(base) is list and typing.get_args(base)[0] is str:
            out.append(f.name)
    return out


# Each field and command pair takes the next separator and, in turn, the config file or a command-line override: with
# 5 separators and 2 ways every pairing occurs, and every command with 5 fields or more sees every separator.
CASES = [(cls, name, command, SEPARATORS[i % len(SEPARATORS)], ("file", "override")[i % 2])
         for i, (cls, name, command) in enumerate((cls, name, command) for cls, commands in COMMANDS.items()
                                                  for name in string_fields(cls) for command in commands)]


def pasted(cls: type, name: str, tmp_path: Path, separator: str) -> Any:
    """Both secrets inside the field's value, each after `separator`, as a user might paste them."""
    base, _ = unwrap_optional(typing.get_type_hints(cls)[name])
    text = (f"{tmp_path}/sec{separator}{TOKEN}{separator}{KEY}" if name in ("output_dir", "cache_dir")
            else f"x{separator}{TOKEN}{separator}{KEY}")
    return [text] if typing.get_origin(base) is list else text


@pytest.mark.parametrize("cls, name, command, separator, source", CASES,
                         ids=[f"{command}-{name}-{source}-{separator}" for _, name, command, separator, source in CASES])
def test_a_secret_in_any_string_field_reaches_no_line(tmp_path, capsys, monkeypatch, cls, name, command, separator,
                                                      source):
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    values = {"model_name": str(tmp_path / "no-model"), "dataset_path": str(tmp_path / "no-data"),
              "output_dir": str(tmp_path / "out")}
    values = {k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls)}}
    value = pasted(cls, name, tmp_path, separator)
    overrides = [f"{name}={yaml.safe_dump(value, default_flow_style=True).strip()}"] if source == "override" else []
    if source == "file":
        values[name] = value
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(values))
    with pytest.raises(SystemExit):
        main([command, "--config", str(config), *overrides])
    out, err = capsys.readouterr()
    assert TOKEN not in out + err and KEY not in out + err
    assert "Traceback" not in err


def test_a_library_log_file_holds_no_secret(tmp_path, monkeypatch):
    """Records logged through Python's logging are scrubbed for every handler, a file handler a library adds (as
    wandb's debug.log) included, whether the secret is in the message or in its arguments."""
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    handler = logging.FileHandler(tmp_path / "debug.log")
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    logger = logging.getLogger("some_library.module")
    logger.addHandler(handler)
    try:
        with scrubbed_output():
            logger.warning("Logging user logs to %s", f"{tmp_path}/sec_{TOKEN}/logs/{KEY}.log")
            logger.warning(f"run dir {tmp_path}/sec_{TOKEN}")
        logger.warning("after: %s", "hf_not_a_token")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert (tmp_path / "debug.log").read_text().splitlines() == [
        f"some_library.module Logging user logs to {tmp_path}/sec_***/logs/***.log",
        f"some_library.module run dir {tmp_path}/sec_***", "some_library.module after: hf_not_a_token"]
    # A record whose arguments do not fit its format is left as it is, for logging to report where it is emitted.
    record = scrubbing_records(logging.LogRecord, [KEY])("x", logging.INFO, "f.py", 1, "%d of %s", (KEY,), None)
    assert (record.msg, record.args) == ("%d of %s", (KEY,))


@pytest.mark.parametrize("argv, output_dir, recorded", [
    (["train.py", "--config", "c.yaml", f"save_name=org/m_{TOKEN}"], "runs/a", False),
    (["train.py", "--config", "c.yaml"], f"runs/sec_{TOKEN}", False),
    (["train.py", "--config", "c.yaml", f"wandb_entity=team.{KEY}"], "runs/a", False),
    (["train.py", "--config", "c.yaml", "save_name=org/hf_model"], "runs/hf_home", True),
])
def test_wandb_records_its_metadata_only_where_it_holds_no_secret(monkeypatch, argv, output_dir, recorded):
    """wandb's metadata holds the command line and the run's folder: with a secret in either, none is recorded."""
    monkeypatch.setenv("MY_SERVICE_KEY", KEY)
    monkeypatch.setattr(sys, "argv", argv)
    assert wandb_settings(output_dir).x_disable_meta is not recorded


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


# A process that tracks to wandb (offline) from inside the CLI's scrubbing, as train does, and prints a secret while
# wandb copies the console into its run file.
WANDB_PRINTING = """
import sys
from gpt4all_training.config.blocks import Logging
from gpt4all_training.config.secrets import scrubbed_output
from gpt4all_training.tracking.tracker import Tracker

output_dir, line = sys.argv[1:]
with scrubbed_output():
    tracker = Tracker(output_dir, Logging(report_to=["wandb"]), {"lr": 0.1}, enabled=True)
    print(line)
    print(line, file=sys.stderr)
    tracker.log({"loss": 1.0}, step=1)
    tracker.close()
"""


def test_what_wandb_copies_of_the_console_is_scrubbed(tmp_path):
    """wandb keeps a copy of every line printed while it runs (output.log, the run file): the line as scrubbed, not as
    printed (it wrapped the scrubbed streams and was handed the line before scrubbing, cut to the scrubbed length)."""
    line = f"saved {tmp_path}/sec_{TOKEN}/step_2 (and {KEY}), a line longer after the token than the token is"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MY_SERVICE_KEY": KEY, "WANDB_MODE": "offline",
           **{name: str(tmp_path / "home") for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")}}
    result = subprocess.run([PYTHON, "-c", WANDB_PRINTING, str(tmp_path / "out"), line], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, explain(result)
    hidden = f"saved {tmp_path}/sec_***/step_2 (and ***), a line longer after the token than the token is"
    assert result.stdout.splitlines() == [hidden] and hidden in result.stderr.splitlines()
    written = [p for folder in (tmp_path / "out", tmp_path / "home") for p in folder.rglob("*") if p.is_file()]
    copies = [p for p in written if p.name == "output.log"]
    assert copies and all(p.read_text().splitlines() == [hidden, hidden] for p in copies)
    assert any(p.suffix == ".wandb" for p in written)
    assert [str(p) for p in written if TOKEN.encode() in p.read_bytes() or KEY.encode() in p.read_bytes()] == []


def random_tokens() -> dict[str, str]:
    """One fresh token of each shape TOKEN_PATTERNS knows, in no environment variable, keyed by its kind."""
    return {"huggingface": "hf_" + secrets.token_hex(17), "gitlab": "glpat-" + secrets.token_hex(10),
            "openai": "sk-proj-" + secrets.token_hex(12), "github": "ghp_" + secrets.token_hex(18),
            "aws": "AKIA" + secrets.token_hex(8).upper(), "slack": "xoxb-" + secrets.token_hex(6)}


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_with_secrets_in_every_field_it_takes_prints_and_snapshots_none(hard_config, hard_data, tiny_model_dir,
                                                                               tmp_path):
    """An environment secret and tokens of every shape, each after another separator (`_ - . / =`), in the model's,
    data's, output's and cache's paths, the Hub repo (pushed to at the end: offline, it warns) and the wandb names,
    half in the config file and half as command-line overrides, with wandb (offline) recording the run: nothing the
    run prints, and no file it or the libraries it calls write under output_dir, cache_dir and wandb's own folders
    (checkpoints' and final/'s config.yaml, metrics.jsonl, the report, wandb's run file, metadata and debug logs),
    holds any of them; the config snapshots hold *** in each field."""
    key = secrets.token_hex(12)
    tokens = random_tokens()
    model, data = tmp_path / f"model.{tokens['slack']}", tmp_path / f"data={key}"
    model.symlink_to(tiny_model_dir, target_is_directory=True)
    data.symlink_to(hard_data, target_is_directory=True)
    out, cache, home = tmp_path / f"sec_{tokens['huggingface']}", tmp_path / f"cache={tokens['aws']}", tmp_path / "home"
    config = write_config(tmp_path, {**yaml.safe_load(hard_config.read_text()), "model_name": str(model),
                                     "cache_dir": str(cache), "wandb_entity": f"team-{tokens['gitlab']}"})
    result = run_train(config, out, f"dataset_path={data}", "save_every=2", "push_to_hub=true",
                       f"save_name=someone/{tokens['github']}", f"wandb_project_name=project.{tokens['openai']}",
                       "report_to=jsonl,wandb",
                       env={"MY_SERVICE_KEY": key, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
                            **{name: str(home) for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")}})
    assert result.returncode == 0, explain(result)
    hidden = [key, *tokens.values()]
    printed = result.stdout + result.stderr
    assert [secret for secret in hidden if secret in printed] == []
    assert f"push_to_hub: not pushing {tmp_path}/sec_***/final to someone/***" in printed
    written = [p for folder in (out, cache, home) for p in folder.rglob("*") if p.is_file()]
    assert {"metrics.jsonl", "report.html", "debug.log", "debug-internal.log", "wandb-metadata.json"} - \
        {p.name for p in written} == {"wandb-metadata.json"}  # wandb recorded no metadata: the command holds secrets
    assert any(p.suffix == ".wandb" for p in written) and any(cache.rglob("COMPLETE"))
    assert [str(p) for p in written if any(secret.encode() in p.read_bytes() for secret in hidden)] == []
    for snapshot in (out / "step_2" / "config.yaml", out / "final" / "config.yaml"):
        saved = yaml.safe_load(snapshot.read_text())
        assert {name: saved[name] for name in ("output_dir", "model_name", "dataset_path", "cache_dir", "save_name",
                                               "wandb_project_name", "wandb_entity")} == {
            "output_dir": f"{tmp_path}/sec_***", "model_name": f"{tmp_path}/model.***",
            "dataset_path": f"{tmp_path}/data=***", "cache_dir": f"{tmp_path}/cache=***", "save_name": "someone/***",
            "wandb_project_name": "project.***", "wandb_entity": "team-***"}
