"""Bad inputs that passed validation and then failed with a traceback (or, for the map, were silently misread): each
is now one line naming the key, file or row, with exit code 2, before any work it would spoil."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
import typing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.files import write_config, write_jsonl
from support.paths import DOLLY

from gpt4all_training.analysis.inference import embedding_array
from gpt4all_training.analysis.map.runs import load_run
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.data.clean import clean
from gpt4all_training.data.records import load_records
from gpt4all_training.errors import UserError
from gpt4all_training.model.from_config import build_model_from_config
from gpt4all_training.model.loading import load_model, tokenizer_for
from gpt4all_training.model.lora import apply_lora

from .harness import one_error_line


# ---------------------------------------------------------------- config values

FLOAT_FIELDS = [f.name for f in dataclasses.fields(TrainConfig)
                if typing.get_type_hints(TrainConfig)[f.name] in (float, typing.Optional[float])]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_a_float_that_is_not_finite_is_refused(hard_config, name, value):
    """weight_decay: .inf passed `>= 0` and trained every weight into NaN; every float key is checked the same way."""
    with pytest.raises(UserError) as refused:
        load_config(hard_config, [f"{name}={value}"])
    assert str(refused.value) == f"{name}: must be a finite number, got {float(value)}"


@pytest.mark.parametrize("seed", [-1, 2**32, 2**63 + 1])
def test_a_seed_numpy_or_torch_cannot_take_is_refused(hard_config, seed):
    with pytest.raises(UserError) as refused:
        load_config(hard_config, [f"seed={seed}"])
    assert str(refused.value) == f"seed: must be between 0 and 4294967295 (2^32 - 1), got {seed}"
    assert load_config(hard_config, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


@pytest.mark.parametrize("cls", [TrainConfig, InferenceConfig])
def test_an_empty_output_dir_is_refused(tmp_path, cls):
    """output_dir: '' was the current folder: final/, metrics.jsonl and report.html landed wherever the run started."""
    path = tmp_path / "c.yaml"
    path.write_text("model_name: m\ndataset_path: d\noutput_dir: ''\n")
    with pytest.raises(UserError) as refused:
        load_config(path, cls=cls)
    assert str(refused.value) == "output_dir: must name a folder (empty would write into the current folder), got ''"


@pytest.mark.parametrize("text, line", [("lr: 1e-4\nseed: 1\nlr: 1e-3\n", "key 'lr' is written twice (lines 1 and 3)"),
                                        ("model_config_overrides: {n_layer: 2, n_layer: 4}\n",
                                         "key 'n_layer' is written twice (lines 1 and 1)")])
def test_a_key_written_twice_is_refused(tmp_path, capsys, text, line):
    """YAML keeps the last of two equal keys without a word; the first value would be silently lost."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert one_error_line(capsys, ["train", "--config", str(path), "model_name=m", "dataset_path=d"]) == \
        f"error: config {path}: {line}; keep one"


@pytest.mark.parametrize("key", ["lora_target_modules", "model_config_overrides", "report_to"])
def test_an_alias_bomb_inside_a_valid_key_is_refused_at_once(tmp_path, capsys, key):
    """Nine levels of nine aliases: 387 million strings once expanded (copying the config never ended)."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    body = f"{key}: {{k: *a8}}" if key == "model_config_overrides" else f"{key}: *a8"
    path = tmp_path / "c.yaml"
    path.write_text("x-anchors:\n" + "".join(f"  {level}\n" for level in levels) + body + "\n")
    started = time.monotonic()
    line = one_error_line(capsys, ["train", "--config", str(path), "model_name=m", "dataset_path=d"])
    assert time.monotonic() - started < 5
    assert line == (f"error: config {path}: YAML aliases expand to more than 10,000 values (line 6); write the "
                    f"values out")  # a4 (line 6) is the first anchor past 10,000: 9^4 x 10 + ...


def test_a_missing_tokenizer_is_named_as_tokenizer_name(hard_config, tmp_path):
    config = load_config(hard_config, [f"tokenizer_name={tmp_path / 'no-tokenizer'}"])
    with pytest.raises(UserError) as refused:
        tokenizer_for(config)
    assert str(refused.value) == (f"tokenizer_name: {tmp_path / 'no-tokenizer'} does not exist; give a local folder "
                                  f"or a Hub id like org/name")


def test_a_lora_rank_beyond_the_models_width_is_refused(tiny_model_dir):
    """lora_r: 100000000 asked for 25.6 GB per layer and died in the allocator."""
    with pytest.raises(UserError) as refused:
        apply_lora(load_model(str(tiny_model_dir)), 100_000_000, 16, 0.0, None, False)
    assert str(refused.value) == "lora_r: 100000000 exceeds the model's width 64; use at most 64 (8 to 64 is usual)"


@pytest.mark.parametrize("overrides, message", [
    ({"n_head": 5}, "model_config_overrides: the model cannot be built from them (embed_dim must be divisible by "
                    "num_attention_heads (got `embed_dim`: 64 and `num_attention_heads`: 5).); fix the values"),
    ({"n_layer": "two"}, "model_config_overrides: n_layer: TypeError: Field 'n_layer' expected int, got str "
                         "(value: 'two')"),
])
def test_model_config_overrides_the_model_cannot_take_are_one_line(tiny_model_dir, tokenizer, overrides, message):
    config = TrainConfig(model_name=str(tiny_model_dir), dataset_path="d", objective="causal_lm", init="from_config",
                         model_config=str(tiny_model_dir), model_config_overrides=overrides)
    with pytest.raises(UserError) as refused:
        build_model_from_config(config, tokenizer)
    assert str(refused.value) == message


@pytest.mark.integration
def test_max_length_beyond_the_models_positions_is_one_line_in_train_and_inference(hard_config, hard_data,
                                                                                  tiny_model_dir, tmp_path, capsys):
    """The tiny GPT-J has 512 positions; the first example past them failed inside the forward pass."""
    expected = "error: max_length: 5000 exceeds the model's 512 positions; set max_length to at most 512"
    assert one_error_line(capsys, ["train", "--config", str(hard_config), f"output_dir={tmp_path / 'run'}",
                             "max_length=5000"]) == expected
    inference = write_config(tmp_path, {"model_name": str(tiny_model_dir), "dataset_path": str(hard_data),
                                        "max_length": 5000, "output_dir": str(tmp_path / "inference"),
                                        "num_proc": 1})
    assert one_error_line(capsys, ["inference", "--config", str(inference)]) == expected
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- data

@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_cleaned_files_are_one_line(tmp_path, content):
    """datasets raised StopIteration (an empty file) or "corresponds to no data" (blank lines)."""
    (tmp_path / "x_clean.jsonl").write_bytes(content)
    with pytest.raises(UserError) as refused:
        load_records(str(tmp_path))
    assert str(refused.value) == (f"dataset_path {tmp_path}: no records (the files are empty); run clean.py on the "
                                  f"raw data and check what it kept")


def test_an_empty_file_beside_others_is_skipped(dolly_rows, tmp_path):
    write_jsonl(tmp_path / "a_clean.jsonl", dolly_rows[:5])
    (tmp_path / "b_clean.jsonl").write_bytes(b"")
    assert len(load_records(str(tmp_path))) == 5


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])
def test_invalid_utf8_in_a_cleaned_file_names_the_line(dolly_rows, tmp_path, bad):
    """datasets' JSON reader let the bytes through; tokenization then raised UnicodeDecodeError."""
    path = write_jsonl(tmp_path / "a_clean.jsonl", dolly_rows[:3])
    with open(path, "ab") as f:
        f.write(b'{"prompt": "hello there", "response": "bad ' + bad + b' byte"}\n')
    with pytest.raises(UserError) as refused:
        load_records(str(tmp_path))
    assert str(refused.value) == f"{path}:4: not UTF-8 text; re-encode the file as UTF-8"


def test_a_records_own_index_field_gives_way_to_the_stable_index(dolly_rows, tmp_path):
    write_jsonl(tmp_path / "a_clean.jsonl", [{**row, "index": 7 * i} for i, row in enumerate(dolly_rows[:6])])
    records = load_records(str(tmp_path))
    assert records["index"] == list(range(6)) and records.column_names.count("index") == 1


@pytest.mark.parametrize("rows, message", [
    ([{"question": "what?", "answer": "that"}] * 2,
     "kept 0 of 2 records (unknown_format 2): 2 of them had the fields of none of the formats ({input}'s first line "
     "has the fields: question, answer)"),
    ([{"prompt": "hello there", "source": "x"}],
     "kept 0 of 1 records (missing_response 1): 1 of them had no 'response' field (or it was null) ({input}'s first "
     "line has the fields: prompt, source)"),
    ([{"instruction": "Say hi", "response": 3}],
     "kept 0 of 1 records (non_string_response 1): 1 of them had a 'response' field that is not text ({input}'s "
     "first line has the fields: instruction, response)"),
])
def test_clean_keeping_nothing_exits_2_naming_the_formats_and_the_missing_field(tmp_path, capsys, rows, message):
    source = write_jsonl(tmp_path / "raw.jsonl", rows)
    line = one_error_line(capsys, ["clean", str(source), "--output-dir", str(tmp_path / "out")])
    assert line.startswith("error: clean: " + message.format(input=source) + "; clean.py reads gpt4all records "
                           "(prompt, response), Dolly (instruction, context, response), OpenAI messages")
    prompts = "; prompts without answers, for objective grpo, are read with --prompts"
    assert line.endswith("; rename the fields or convert the file" + (prompts if "missing_response" in message else ""))
    assert json.loads((tmp_path / "out" / "clean_report.json").read_text())["total"]["kept"] == 0


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_the_cleaned_file_follows_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        clean([str(DOLLY)], tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "dolly-sample_clean.jsonl").stat().st_mode) == mode


# ---------------------------------------------------------------- inference

def fake_checkpoint(folder: Path) -> Path:
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "state.json").write_text('{"step": 4}')
    return folder


@pytest.mark.integration
def test_inference_model_name_at_a_checkpoint_or_a_model_without_tokenizer(hard_data, tmp_path, capsys):
    step = fake_checkpoint(tmp_path / "run" / "step_4")
    config = write_config(tmp_path, {"model_name": str(step), "dataset_path": str(hard_data),
                                     "output_dir": str(tmp_path / "inference")})
    assert one_error_line(capsys, ["inference", "--config", str(config)]) == (
        f"error: model_name: {step} is a training checkpoint; give its model folder, {step / 'model'} (a checkpoint "
        f"holds no tokenizer: set tokenizer_name to the base model)")
    assert one_error_line(capsys, ["inference", "--config", str(config), f"model_name={step / 'model'}"]) == (
        f"error: model_name: {step / 'model'} holds no tokenizer (tokenizer.json, tokenizer_config.json, ...); set "
        f"tokenizer_name to the model the tokenizer comes from")


@pytest.mark.integration
def test_inference_output_dir_that_is_a_file_or_cannot_be_made(tiny_model_dir, hard_data, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    config = write_config(tmp_path, {"model_name": str(tiny_model_dir), "dataset_path": str(hard_data)})
    inference = ["inference", "--config", str(config)]
    assert one_error_line(capsys, [*inference, f"output_dir={tmp_path / 'a-file'}"]) == (
        f"error: output_dir {tmp_path / 'a-file'}: is a file, not a folder; choose another output_dir")
    assert one_error_line(capsys, [*inference, f"output_dir={tmp_path / 'a-file' / 'sub'}"]) == (
        f"error: output_dir {tmp_path / 'a-file' / 'sub'}: not writable (Not a directory); fix its permissions or "
        f"choose another output_dir")


# ---------------------------------------------------------------- build_map's input

def inference_table(n: int = 12, dim: int = 8, **replace) -> pa.Table:
    """A table with inference.py's columns and planted values; `replace` swaps whole columns."""
    rng = np.random.default_rng(0)
    columns = {"source": ["s"] * n, "prompt": [f"prompt {i}" for i in range(n)],
               "response": [f"response {i}" for i in range(n)], "index": np.arange(n), "split": ["train"] * n,
               "loss": rng.random(n), "n_tokens": np.full(n, 5),
               "embedding": embedding_array(rng.standard_normal((n, dim)).astype(np.float32))}
    columns.update(replace)
    return pa.table(columns)


def with_embedding(values: list) -> pa.Array:
    return pa.array(values, pa.list_(pa.float32()))


def rows(n: int = 12, dim: int = 8) -> list[list[float]]:
    return np.random.default_rng(1).standard_normal((n, dim)).astype(np.float32).tolist()


BAD_RUNS = {
    "nan": (lambda: inference_table(embedding=with_embedding([*rows()[:3], [float("nan")] * 8, *rows()[4:]])),
            "1 embeddings hold NaN or infinite values, e.g. row 3; the model overflowed: rerun inference.py with "
            "dtype: float32"),
    "inf": (lambda: inference_table(embedding=with_embedding([[float("inf")] + r[1:] for r in rows()])),
            "12 embeddings hold NaN or infinite values, e.g. row 0; the model overflowed: rerun inference.py with "
            "dtype: float32"),
    "ragged": (lambda: inference_table(embedding=with_embedding([r[:-1] if i == 2 else r + [0.0] if i == 5 else r
                                                                 for i, r in enumerate(rows())])),
               "embeddings differ in length (row 0 has 8 values, row 2 has 7); every row needs one vector of the "
               "same size: rerun inference.py"),
    "null row": (lambda: inference_table(embedding=with_embedding([None if i == 4 else r
                                                                   for i, r in enumerate(rows())])),
                 "1 rows have no embedding (null), e.g. row 4; rerun inference.py"),
    "null value": (lambda: inference_table(embedding=with_embedding([[None] * 8 if i == 1 else r
                                                                     for i, r in enumerate(rows())])),
                   "embeddings hold 8 missing (null) values; rerun inference.py"),
    "strings": (lambda: inference_table(embedding=pa.array([["a"] * 8] * 12)),
                "column 'embedding' holds list<element: string>, not lists of numbers; rerun inference.py"),
    "int prompts": (lambda: inference_table(prompt=list(range(12))),
                    "column 'prompt' holds int64, not text; is this inference.py output?"),
    "null response": (lambda: inference_table(response=[None] + [f"r{i}" for i in range(11)]),
                      "column 'response' has 1 empty (null) rows, e.g. row 0; rerun inference.py"),
    "text loss": (lambda: inference_table(loss=["low"] * 12),
                  "column 'loss' holds string, not numbers; is this inference.py output?"),
}


@pytest.mark.parametrize("case", BAD_RUNS)
def test_a_bad_inference_table_is_one_line_naming_the_row(tmp_path, capsys, case):
    make, message = BAD_RUNS[case]
    pq.write_table(make(), tmp_path / "inference.parquet")
    with pytest.raises(UserError) as refused:
        load_run(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'inference.parquet'}: {message}"
    assert one_error_line(capsys, ["build_map", "--input", str(tmp_path), "--output", str(tmp_path / "map.html")]) == \
        f"error: {refused.value}"
    assert not (tmp_path / "map.html").exists()


def test_a_good_inference_table_still_loads(tmp_path):
    pq.write_table(inference_table(), tmp_path / "inference.parquet")
    run = load_run(tmp_path)
    assert run.embeddings.shape == (12, 8) and run.embeddings.dtype == np.float32


@pytest.mark.parametrize("content", [b"hello, not parquet\n", "cut"])
def test_a_corrupt_or_non_parquet_input_is_one_line(tmp_path, content):
    path = tmp_path / "inference.parquet"
    if content == "cut":
        pq.write_table(inference_table(), path)
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        load_run(tmp_path)
    assert str(refused.value).startswith(f"{path}: not a readable Parquet file (")
    assert str(refused.value).endswith("); run inference.py again to write it")


@pytest.mark.parametrize("output, message", [
    ("a-file/map.html", "{tmp}/a-file is a file, not a folder; choose another path"),
    ("folder", "is a folder; give a file path, e.g. {tmp}/folder/map.html"),
    ("/proc/map.html", "cannot write there (No such file or directory); choose another path"),
])
def test_a_map_output_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys, output, message):
    pq.write_table(inference_table(), tmp_path / "inference.parquet")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "folder").mkdir()
    target = output if output.startswith("/") else str(tmp_path / output)
    assert one_error_line(capsys, ["build_map", "--input", str(tmp_path), "--output", target]) == (
        f"error: --output {target}: {message.format(tmp=tmp_path)}")


# ---------------------------------------------------------------- secrets in error lines

def test_a_token_in_a_config_value_never_reaches_an_error_line(hard_config, tmp_path, capsys, monkeypatch):
    token = "hf_" + "q" * 30
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("SERVICE_API_KEY", "k" * 20)
    line = one_error_line(capsys, ["train", "--config", str(hard_config), f"output_dir={tmp_path}",
                             f"model_name=/models/{token}/{'k' * 20}"])
    assert line == "error: model_name: /models/***/*** does not exist; give a local folder or a Hub id like org/name"

