"""config/: every gpt4all key, defaults, typed `key=value` overrides, and one-line errors with exit code 2.

Most CLI cases call the `data` subcommand in-process (its first act is loading the config, as `train` does, and it
imports far less); two run `train.py` and `data.py` as real subprocesses to show the stderr line and exit code.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml
from support.paths import PYTHON, REPO

from gpt4all_training import cli
from gpt4all_training.config.loader import load_config, save_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError

TRAIN_CONFIGS = REPO / "configs" / "train"
REQUIRED = "model_name: my-model\ndataset_path: my-data\n"

# Every key gpt4all's configs used, with the values of its finetune_gptj.yaml where it had one.
GPT4ALL_KEYS = """
model_name: EleutherAI/gpt-j-6B
tokenizer_name: EleutherAI/gpt-j-6B
gradient_checkpointing: true
save_name: nomic-ai/gpt4all-j
streaming: false
num_proc: 64
dataset_path: nomic-ai/gpt4all-j-prompt-generations
revision: v1.2-jazzy
max_length: 1024
batch_size: 32
lr: 2.0e-5
min_lr: 0
weight_decay: 0.0
eval_every: 500
eval_steps: 105
save_every: 500
log_grads_every: 100
log_lr_every: 10
log_every: 10
output_dir: ckpts/gpt4all-j
checkpoint: null
lora: false
warmup_steps: 500
num_epochs: 2
wandb: true
wandb_entity: nomic
wandb_project_name: gpt4all
seed: 42
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_every_gpt4all_key_is_accepted_with_its_meaning(tmp_path):
    config = load_config(write(tmp_path, GPT4ALL_KEYS))
    expected = yaml.safe_load(GPT4ALL_KEYS)
    expected["lr"], expected["min_lr"] = 2.0e-5, 0.0  # YAML 1.1 reads 2.0e-5 as a string; ints widen to float
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.report_to == ["jsonl", "wandb"]  # gpt4all's `wandb: true` turns the wandb tracker on


def test_only_model_name_and_dataset_path_are_needed(tmp_path):
    config = load_config(write(tmp_path, REQUIRED))
    assert config == TrainConfig(model_name="my-model", dataset_path="my-data")
    defaults = {"lr": 2.0e-5, "min_lr": 0.0, "batch_size": 8, "max_length": 1024, "val_fraction": 0.05,
                "gradient_accumulation_steps": 1, "max_steps": None, "max_grad_norm": 1.0, "warmup_steps": 100,
                "num_epochs": 1, "seed": 42, "eval_every": 500, "save_every": 500, "keep_last": 2,
                "lora": False, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_modules": None,
                "trust_remote_code": False, "dtype": "auto", "report_to": ["jsonl"], "push_to_hub": False}
    assert {key: getattr(config, key) for key in defaults} == defaults


def test_every_field_has_a_doc():
    undocumented = [f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("doc")]
    assert undocumented == []


def test_overrides_are_parsed_to_the_field_type(tmp_path):
    config = load_config(write(tmp_path, REQUIRED), ["lr=1e-4", "max_steps=5", "lora=true",
                                                     "lora_target_modules=q_proj,v_proj", "eval_every=",
                                                     "report_to=jsonl,tensorboard", "revision=v1.2-jazzy"])
    assert (config.lr, type(config.lr)) == (1e-4, float)
    assert (config.max_steps, type(config.max_steps)) == (5, int)
    assert config.lora is True
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.eval_every is None  # an empty value unsets an optional key
    assert config.report_to == ["jsonl", "tensorboard"]
    assert config.revision == "v1.2-jazzy"


def test_overrides_win_over_the_file(tmp_path):
    config = load_config(write(tmp_path, REQUIRED + "lr: 3.0e-5\nbatch_size: 16\n"), ["batch_size=2"])
    assert (config.lr, config.batch_size) == (3.0e-5, 2)


def test_yaml_exponent_without_a_dot_is_a_float(tmp_path):
    assert yaml.safe_load("lr: 5e-5") == {"lr": "5e-5"}  # the YAML 1.1 quirk this guards against
    config = load_config(write(tmp_path, REQUIRED + "lr: 5e-5\nmin_lr: 1e-6\nmax_steps: 1e3\n"))
    assert (config.lr, config.min_lr, config.max_steps) == (5e-5, 1e-6, 1000)
    assert type(config.lr) is float and type(config.max_steps) is int


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(write(tmp_path, GPT4ALL_KEYS), ["lora_target_modules=q_proj,v_proj"])
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == config


# ---------------------------------------------------------------- shipped configs

def test_gptj_config_has_gpt4all_j_published_hyperparameters():
    config = load_config(TRAIN_CONFIGS / "finetune_gptj.yaml")
    assert (config.model_name, config.dataset_path, config.revision) == (
        "EleutherAI/gpt-j-6B", "nomic-ai/gpt4all-j-prompt-generations", "v1.2-jazzy")
    assert (config.lr, config.min_lr, config.batch_size, config.warmup_steps, config.num_epochs) == (
        2e-5, 2e-5, 32, 500, 2)
    assert (config.max_length, config.eval_every, config.save_every, config.weight_decay) == (1024, 500, 500, 0.0)
    assert (config.dtype, config.gradient_checkpointing, config.lora) == ("bfloat16", True, False)


def test_gptj_lora_config_has_gpt4all_j_published_hyperparameters():
    config = load_config(TRAIN_CONFIGS / "finetune_gptj_lora.yaml")
    assert (config.model_name, config.dataset_path, config.revision) == (
        "EleutherAI/gpt-j-6B", "nomic-ai/gpt4all-j-prompt-generations", "v1.2-jazzy")
    assert (config.lr, config.batch_size, config.warmup_steps, config.num_epochs, config.max_length) == (
        2e-5, 4, 500, 2, 1024)
    assert (config.lora, config.lora_r, config.lora_alpha, config.lora_dropout) == (True, 8, 32, 0.1)
    assert (config.dtype, config.gradient_checkpointing) == ("bfloat16", False)


def test_tiny_config_names_the_packaged_model_and_clean_py_s_folder_and_takes_others():
    config = load_config(TRAIN_CONFIGS / "finetune_tiny.yaml")  # as written: nothing is missing (issue 27)
    assert (config.model_name, config.dataset_path) == ("smollm2", "./data/clean")
    config = load_config(TRAIN_CONFIGS / "finetune_tiny.yaml", ["model_name=tiny-model", "dataset_path=data/clean"])
    assert (config.model_name, config.max_length, config.max_steps, config.dtype) == ("tiny-model", 128, 8, "float32")


# ---------------------------------------------------------------- one-line errors, exit code 2

BAD_CONFIGS = [
    ("unknown key", REQUIRED + "num_epoch: 2\n", "num_epoch: unknown key in {path}; did you mean 'num_epochs'?"),
    ("wrong type int", REQUIRED + "batch_size: eight\n", "batch_size: expected an integer, got 'eight'"),
    ("wrong type bool", REQUIRED + "lora: maybe\n", "lora: expected true or false, got 'maybe'"),
    ("wrong type float", REQUIRED + "lr: fast\n", "lr: expected a number, got 'fast'"),
    ("lr zero", REQUIRED + "lr: 0\n", "lr: must be > 0, got 0.0"),
    ("lr negative", REQUIRED + "lr: -1e-5\n", "lr: must be > 0, got -1e-05"),
    ("min_lr above lr", REQUIRED + "min_lr: 1e-3\n", "min_lr: must be between 0 and lr (2e-05), got 0.001"),
    ("max_length", REQUIRED + "max_length: 1\n", "max_length: must be at least 2, got 1"),
    ("batch_size", REQUIRED + "batch_size: 0\n", "batch_size: must be at least 1, got 0"),
    *[(f"{key} zero", REQUIRED + f"{key}: 0\n", f"{key}: must be at least 1 (or unset to disable), got 0")
      for key in ("eval_every", "save_every", "log_grads_every", "log_lr_every")],
    ("log_every zero", REQUIRED + "log_every: 0\n", "log_every: must be at least 1, got 0"),
    ("missing dataset_path", "model_name: my-model\n",
     "dataset_path: missing; set it in the config or on the command line as dataset_path=..."),
    ("missing model_name", "dataset_path: my-data\n",
     "model_name: missing; set it in the config or on the command line as model_name=..."),
    ("invalid YAML", REQUIRED + "lr: [1e-4\nbatch_size: 8\n", "config {path}: not valid YAML (line 4); check the syntax"),
    ("not a mapping", "- model_name\n- dataset_path\n", "config {path}: expected a mapping of key: value at the top level"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_is_one_line_naming_the_key_and_exit_2(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["data", "--config", str(path)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert (captured.out, captured.err) == ("", f"error: {message.format(path=path)}\n")


def test_missing_config_file_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["data", "--config", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: config {path}: file not found; pass an existing YAML file to --config\n"


def test_unknown_override_says_it_came_from_the_command_line(tmp_path):
    with pytest.raises(UserError) as error:
        load_config(write(tmp_path, REQUIRED), ["lrr=1e-4"])
    assert str(error.value) == "lrr: unknown key in the command-line overrides; did you mean 'lr'?"
    with pytest.raises(UserError) as error:
        load_config(write(tmp_path, REQUIRED), ["max_steps=five"])
    assert str(error.value) == "max_steps: expected an integer, got 'five'"


@pytest.mark.parametrize("script, text, overrides, message", [
    ("train.py", "lr: [1e-4\n", [], "error: config {path}: not valid YAML (line 2); check the syntax"),
    ("data.py", REQUIRED, ["lr=0"], "error: lr: must be > 0, got 0.0"),
], ids=["train.py invalid YAML", "data.py bad override"])
@pytest.mark.integration
def test_script_prints_one_line_without_traceback(tmp_path, script, text, overrides, message):
    path = write(tmp_path, text)
    result = subprocess.run([PYTHON, script, "--config", str(path), *overrides], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message.format(path=path) + "\n")


@pytest.mark.parametrize("entries, message", [
    ([{"name": "bleu"}], "entry 1: no built-in reward is called 'bleu'; the built-in ones are exact_match, "
                         "numeric_match, format, length_penalty (your own function: module and function)"),
    ([{"module": "r.py"}], "entry 1: give name (one of exact_match, numeric_match, format, length_penalty), or module "
                           "(a .py file) and function (the name of a function in it)"),
    ([{"name": "exact_match", "tolerance": 1}],
     "entry 1 (exact_match): unknown key 'tolerance'; it takes name, field, pattern, weight"),
    ([{"module": "r.py", "function": "f", "field": "a"}],
     "entry 1 (f): unknown key 'field'; it takes module, function, weight"),
    ([{"name": "format", "pattern": "x"}, {"name": "format", "pattern": "y"}],
     "format is named twice, so their metrics (rewards/format/mean) would mix; keep one"),
])
def test_a_reward_entry_is_refused_naming_the_entry_and_what_is_wrong(entries, message):
    from gpt4all_training.config.rewards import reward_problem

    assert reward_problem(entries, 16) == message
