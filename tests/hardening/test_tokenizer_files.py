"""Issue 40, class 7: a model folder whose tokenizer.json (or another tokenizer file) is not what transformers reads
is one line naming the file, on every command that loads a tokenizer, never a traceback; nothing is written.

transformers reads a folder's tokenizer files with json.load and indexes what it gets, so each damage surfaced as
another exception naming no file (JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ...). The one tokenizer
loader (model/loading.load_tokenizer) names the file instead; `COMMANDS` lists every command that reaches it, and each
gets every content of `BAD`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.launch import explain

from gpt4all_training.errors import UserError
from gpt4all_training.model.loading import CHAT_TEMPLATE_FILE, TOKENIZER_JSON_FILES, load_tokenizer

from .entry_points import clean_failure, snapshot
from .harness import error_lines, run_train

RESTORE = "; restore the file from where the model came from"
# content -> what the line says after the file's name
BAD = {
    b"{not json": f": not valid JSON (line 1, column 2: Expecting property name enclosed in double quotes){RESTORE}",
    b"": f": not valid JSON (line 1, column 1: Expecting value){RESTORE}",
    b"\xff\xfe{}": ":1: not UTF-8 text (byte 0); re-encode the file as UTF-8",
    b"[1, 2]": f": expected a JSON object, got list{RESTORE}",
    b"{}": f": not a tokenizer the tokenizers library can read (Model missing. at line 1 column 2){RESTORE}",
}


def write_config(path: Path, **values) -> Path:
    path.write_text("".join(f"{key}: {value}\n" for key, value in values.items()))
    return path


def train_config(t: Path, data: Path) -> Path:
    return write_config(t / "train.yaml", model_name=t / "model", dataset_path=data, output_dir=t / "out",
                        max_length=32, batch_size=4, num_proc=1, max_steps=2, dtype="float32")


# (name, the option that names the model in the line, model folder ("gptj" or "llama"), exit code, the command line)
COMMANDS = [
    ("train", "model_name", "gptj", 2, lambda t, d: ["train", "--config", str(train_config(t, d))]),
    ("data", "model_name", "gptj", 2, lambda t, d: ["data", "--config", str(train_config(t, d))]),
    ("plan", "model_name", "gptj", 2, lambda t, d: ["plan", "--config", str(train_config(t, d))]),
    ("inference", "model_name", "gptj", 2, lambda t, d: [
        "inference", "--config", str(write_config(t / "inference.yaml", model_name=t / "model", dataset_path=d,
                                                  output_dir=t / "out", max_length=32, batch_size=4))]),
    ("generate", "model_name", "gptj", 2, lambda t, d: ["generate", f"model_name={t / 'model'}", "--prompt", "hi"]),
    ("export --format hf", "--from", "gptj", 2, lambda t, d: [
        "export", "--from", str(t / "model"), "--to", str(t / "exported"), "--format", "hf"]),
    ("export --format gguf", "--from", "llama", 2, lambda t, d: [
        "export", "--from", str(t / "model"), "--to", str(t / "exported"), "--format", "gguf"]),
    ("serve", "--model", "gptj", 2, lambda t, d: ["serve", "--model", str(t / "model"), "--port", "0", "--device",
                                                   "cpu"]),
]
CASES = [(*command, content) for command in COMMANDS for content in BAD]


@pytest.mark.parametrize("name, key, family, code, command, content", CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_a_tokenizer_json_that_cannot_be_read_is_one_line_naming_it(tiny_model_dir, tiny_llama_dir, hard_data,
                                                                    tmp_path, capsys, name, key, family, code,
                                                                    command, content):
    model = shutil.copytree(tiny_llama_dir if family == "llama" else tiny_model_dir, tmp_path / "model")
    (model / "tokenizer.json").write_bytes(content)
    (tmp_path / "out").mkdir()  # train and inference make their output_dir before they load the tokenizer
    argv = command(tmp_path, hard_data)  # writes the command's config file
    before = snapshot(tmp_path)
    line = clean_failure(capsys, argv, code)
    assert line == f"error: {key} {model}: tokenizer file {model / 'tokenizer.json'}{BAD[content]}"
    assert snapshot(tmp_path) == before


def test_check_reports_the_tokenizer_file_as_its_failed_check(tiny_model_dir, hard_data, tmp_path, capsys):
    """`check` runs every check and reports each: the tokenizer's is the one that fails, naming the file."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "tokenizer.json").write_bytes(b"{not json")
    with pytest.raises(SystemExit) as exit_info:
        from gpt4all_training.cli.main import main

        main(["check", "--config", str(train_config(tmp_path, hard_data))])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert [line for line in out.splitlines() if line.startswith("FAIL")] == [
        f"FAIL  tokenizer: model_name {model}: tokenizer file {model / 'tokenizer.json'}{BAD[b'{not json']}"]


@pytest.mark.parametrize("file", [*TOKENIZER_JSON_FILES, CHAT_TEMPLATE_FILE])
@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe{}", b"[1, 2]"])
def test_every_tokenizer_file_is_named(tiny_model_dir, tmp_path, file, content):
    """Each file transformers may read a tokenizer from, damaged, is named: in the tiny model's folder (a
    tokenizer.json tokenizer) or in a GPT-2 style one (vocab.json and merges.txt, read by GPT2Tokenizer), where
    vocab.json is read. The chat template is text: only bytes that are not UTF-8 fail it."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    if file == "vocab.json":
        saved = json.loads((model / "tokenizer.json").read_text())["model"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in saved["merges"]]
        (model / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]))
        (model / "tokenizer.json").unlink()
        (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    (model / file).write_bytes(content)
    if file == CHAT_TEMPLATE_FILE and content != b"\xff\xfe{}":
        assert load_tokenizer(str(model)).chat_template == content.decode()
        return
    with pytest.raises(UserError) as refused:
        load_tokenizer(str(model))
    assert str(refused.value) == f"model_name {model}: tokenizer file {model / file}{BAD[content]}"


@pytest.mark.integration
@pytest.mark.slow
def test_train_script_with_a_bad_tokenizer_json_prints_one_line_and_no_traceback(hard_config, tiny_model_dir,
                                                                                 tmp_path):
    """The same through `python train.py`, a real process: what a user sees is the one line."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "tokenizer.json").write_bytes(b"{not json")
    result = run_train(hard_config, tmp_path / "out", f"model_name={model}")
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        f"error: model_name {model}: tokenizer file {model / 'tokenizer.json'}{BAD[b'{not json']}"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
