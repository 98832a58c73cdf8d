"""`check`: every failure is one line that says what to fix; a good config passes, dry run included."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from support.files import dolly_texts, write_jsonl
from support.paths import DOLLY
from gpt4all_training.preflight import check
from gpt4all_training.cli.check import run
from gpt4all_training.preflight.check import GIB, memory_problem, room_problem, run_checks
from gpt4all_training.preflight.plan import Memory


def write_config(folder: Path, **values) -> Path:
    path = folder / "c.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()), encoding="utf-8")
    return path


@pytest.fixture
def base_values(tiny_model_dir, clean_dolly, tmp_path) -> dict:
    return dict(model_name=str(tiny_model_dir), dataset_path=str(clean_dolly), output_dir=str(tmp_path / "out"),
                max_length=64, batch_size=4, lr=1e-3, min_lr=1e-4, warmup_steps=0, num_proc=1, report_to=["jsonl"])


def outcomes_of(tmp_path, values: dict, overrides: list[str] | None = None) -> dict[str, str]:
    """{check name: its line}; a name that occurs twice keeps the failing line."""
    lines: dict[str, str] = {}
    for outcome in run_checks(str(write_config(tmp_path, **values)), overrides or [], report=lambda line: None):
        if outcome.name not in lines or not outcome.ok:
            lines[outcome.name] = outcome.line()
    return lines


@pytest.mark.integration
def test_a_good_config_passes_with_a_dry_run(base_values, tmp_path, capsys):
    config = write_config(tmp_path, **base_values)
    assert run(argparse.Namespace(config=str(config), overrides=[])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "ok    config", "ok    dataset", "ok    model_name", "ok    tokenizer", "ok    memory", "ok    output_dir",
        "ok    dry run"]
    assert re.fullmatch(r"ok    dry run: 2 steps on 2 examples passed \(loss \d+\.\d{4} -> \d+\.\d{4}\); "
                        r"[\d,]+ tokens/s at batch 1, peak RSS [\d,]+ MiB", lines[-2]), lines[-2]
    assert lines[-1] == "all 7 checks passed"
    assert "records, all with prompt, response" in lines[1]
    assert not (tmp_path / "out").exists()  # the dry run trains in a temporary folder


def test_invalid_config_fails_in_one_line_and_skips_the_dry_run(base_values, tmp_path):
    lines = outcomes_of(tmp_path, {**base_values, "lr": -1})
    assert lines["config"] == "FAIL  config: lr: must be > 0, got -1.0"
    assert "dry run" not in lines
    unknown = outcomes_of(tmp_path, base_values, ["lrr=1"])
    assert unknown == {"config": "FAIL  config: lrr: unknown key in the command-line overrides; did you mean 'lr'?"}


def test_dataset_failures_name_the_first_bad_line(base_values, tmp_path):
    data = tmp_path / "data"
    good = {"prompt": "p", "response": "r", "source": "s"}
    write_jsonl(data / "a_clean.jsonl", [good, good, {"prompt": "p", "source": "s"}, {"prompt": 1}])
    lines = outcomes_of(tmp_path, {**base_values, "dataset_path": str(data)})
    assert lines["dataset"] == (f"FAIL  dataset: {data / 'a_clean.jsonl'}:3: no 'response' field (fields: prompt, "
                                f"source); run clean.py on the raw data first")
    (data / "a_clean.jsonl").write_text('{"prompt": "p", "response": "r"}\n{"prompt": "p", "resp\n')
    assert outcomes_of(tmp_path, {**base_values, "dataset_path": str(data)})["dataset"] == \
        f"FAIL  dataset: {data / 'a_clean.jsonl'}:2: not valid JSON (Invalid control character at); fix or remove " \
        f"the line"
    raw = outcomes_of(tmp_path, {**base_values, "dataset_path": str(DOLLY)})
    assert raw["dataset"].startswith(f"FAIL  dataset: {DOLLY}:1: no 'prompt' field (fields: instruction, context, ")
    missing = outcomes_of(tmp_path, {**base_values, "dataset_path": str(tmp_path / "nope.jsonl")})
    assert missing["dataset"] == f"FAIL  dataset: dataset_path: {tmp_path / 'nope.jsonl'} does not exist"
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    assert outcomes_of(tmp_path, {**base_values, "dataset_path": str(empty_folder)})["dataset"] == \
        f"FAIL  dataset: dataset_path {empty_folder}: no *_clean.jsonl files in the folder; run clean.py on the raw " \
        f"data first"


def test_tokenizer_of_another_vocabulary_is_refused(base_values, tmp_path):
    """A GPT-2-style tokenizer of 1,200 tokens with a model of 1,000: ids past 999 would index outside it."""
    from gpt4all_training.data.bpe import train_bpe_tokenizer

    other = tmp_path / "other-tokenizer"
    train_bpe_tokenizer(dolly_texts(), vocab_size=1200).save_pretrained(other)
    lines = outcomes_of(tmp_path, {**base_values, "tokenizer_name": str(other)})
    assert lines["tokenizer"] == ("FAIL  tokenizer: the tokenizer has 1,200 tokens but the model's vocabulary is "
                                  "1,000: ids past it index outside the embedding; use the model's own tokenizer "
                                  "(unset tokenizer_name)")
    assert "dry run" not in lines


def test_tokenizer_with_another_eos_and_a_too_long_max_length(base_values, tiny_model_dir, tmp_path):
    model = tmp_path / "eos3"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 3, "bos_token_id": 3}))
    lines = outcomes_of(tmp_path, {**base_values, "model_name": str(model), "max_length": 1024})
    assert lines["tokenizer"] == (
        "FAIL  tokenizer: the tokenizer's EOS is id 0 ('<|endoftext|>') but the model's eos_token_id is 3: the "
        "tokenizer belongs to another model; use the model's own tokenizer; the tokenizer's BOS is id 0 "
        "('<|endoftext|>') but the model's bos_token_id is 3: the tokenizer belongs to another model; use the "
        "model's own tokenizer; max_length 1024 exceeds the model's 512 positions; set max_length to at most 512")


def test_adapter_folder_is_recognised_and_a_lost_base_is_not(base_values, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from gpt4all_training.model.lora import apply_lora

    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    apply_lora(base, 4, 8, 0.0, ["q_proj", "v_proj"], False).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    ok = outcomes_of(tmp_path, {**base_values, "model_name": str(adapter)})
    assert ok["model_name"] == (f"ok    model_name: {adapter} is a LoRA adapter folder; it loads as its base "
                                f"{tiny_model_dir} plus the adapter")
    assert ok["tokenizer"].startswith("ok")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": "/gone/base"}))
    lost = outcomes_of(tmp_path, {**base_values, "model_name": str(adapter)})
    assert lost["model_name"] == (f"FAIL  model_name: {adapter} is a LoRA adapter whose base model /gone/base is not "
                                  f"found; give its base as model_name, or fix base_model_name_or_path in "
                                  f"adapter_config.json")


def test_checkpoint_folder_as_model_name_points_at_its_model(base_values, tiny_model_dir, tmp_path):
    step = tmp_path / "step_4"
    shutil.copytree(tiny_model_dir, step / "model")
    lines = outcomes_of(tmp_path, {**base_values, "model_name": str(step)})
    assert lines["model_name"] == (f"FAIL  model_name: {step} has no config.json (not a model folder); did you mean "
                                   f"{step / 'model'}?")


def test_output_dir_unwritable_or_full(base_values, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    lines = outcomes_of(tmp_path, {**base_values, "output_dir": str(blocker / "run")})
    assert lines["output_dir"] == (f"FAIL  output_dir: {blocker / 'run'}: {blocker} is not writable (Not a "
                                   f"directory); choose another output_dir")
    # The tiny GPT-J: 228,328 fp32 parameters plus two Adam moments = 12 bytes each.
    monkeypatch.setattr(check.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1_000_000))
    full = outcomes_of(tmp_path, base_values)
    assert full["output_dir"] == (f"FAIL  output_dir: {tmp_path / 'out'}: 1.0 MiB free but one checkpoint needs "
                                  f"about 2.6 MiB (fp32 weights and Adam states); free some space or choose another "
                                  f"output_dir")
    assert room_problem(1_000_000, 12 * 228_328) is not None and room_problem(12 * 228_328, 12 * 228_328) is None


def test_missing_tracker_is_named(base_values, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an uninstalled package looks like to import
    lines = outcomes_of(tmp_path, {**base_values, "report_to": ["jsonl", "wandb", "tensorboard"]})
    assert lines["report_to"] == ("FAIL  report_to: tensorboard is requested but not installed; pip install "
                                  "tensorboard, or remove it from report_to")
    assert "dry run" not in lines


def test_memory_that_cannot_fit_says_what_to_lower():
    config = argparse.Namespace(batch_size=32, max_length=2048)
    assert memory_problem(config, Memory(30 * GIB, 30 * GIB, 60 * GIB, 0), 80 * GIB, "GPU") == (
        "the weights, gradients and Adam states alone need 120.0 GiB but the GPU has 80.0 GiB; use lora: true or "
        "DeepSpeed ZeRO-3 across GPUs")
    # A frozen reference copy (dpo's frozen_copy): ZeRO-3 refuses it, so it is not offered.
    assert memory_problem(config, Memory(30 * GIB, 30 * GIB, 60 * GIB, 0, 30 * GIB), 80 * GIB, "GPU") == (
        "the weights, gradients and Adam states alone need 120.0 GiB but the GPU has 80.0 GiB; use lora: true (the "
        "reference is then the base with the adapter off)")
    assert memory_problem(config, Memory(10 * GIB, 10 * GIB, 20 * GIB, 50 * GIB), 80 * GIB, "GPU") == (
        "batch_size 32 x max_length 2048 needs about 90.0 GiB (50.0 GiB of activations) but the GPU has 80.0 GiB; "
        "lower batch_size (raise gradient_accumulation_steps to keep the global batch) or max_length, or set "
        "gradient_checkpointing: true")
    assert memory_problem(config, Memory(10 * GIB, 10 * GIB, 20 * GIB, 30 * GIB), 80 * GIB, "GPU") is None


@pytest.mark.integration
def test_failing_dry_run_is_one_line_and_exit_code_1(base_values, tmp_path, capsys):
    """An absurd learning rate: step 1 is finite, its update overflows the weights, step 2's loss is not."""
    config = write_config(tmp_path, **{**base_values, "lr": 1e30, "min_lr": 1e30, "max_grad_norm": None})
    assert run(argparse.Namespace(config=str(config), overrides=[])) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("FAIL  dry run: step 2: the loss is ") and lines[-2].endswith(
        "; lower lr, check the data, or use float32")
    assert lines[-1] == "6 passed, 1 failed"
