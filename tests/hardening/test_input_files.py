"""Issue 28, class 5: an input file with undecodable bytes or absurd values is one line naming the file, on every
command that reads one, never a traceback; nothing is written.

`INPUTS` lists each input file a command takes besides dataset records (which `data/records.py` reads and counts):
configs, prompt and conversation files, curate's selection files, eval's `--compare`, and the files of a model folder
`export` reads. Each gets every content of `BAD` that applies to its kind: bytes that are not UTF-8 (a lone
continuation byte, an encoded surrogate, a code point past U+10FFFF), text that is not its format, JSON nested
100,000 levels, a number of 5,000 digits, and the absurd values of its own kind (ids of 10^23 and -1, a config.json
that is a list, names code of its own or a model type nobody knows). All go through `readers.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.inference_runs import write_inference_run

from .entry_points import clean_failure, snapshot

NOT_UTF8 = [b"ok\n\x80 continuation\n", b"\xed\xa0\x80 surrogate\n", b"\xf4\x90\x80\x80 past U+10FFFF\n"]
DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE = b"[" + b"9" * 5000 + b"]"
BAD = {
    "yaml": [*NOT_UTF8, b"key: [unclosed\n", b"- a list\n- not a mapping\n", DEEP],
    "text": NOT_UTF8,
    "jsonl": [*NOT_UTF8, b'{"prompt": \n', DEEP + b"\n", HUGE + b"\n"],
    "json": [*NOT_UTF8, b"{not json", DEEP, HUGE, b"[1, 2]"],
    "ids": [*NOT_UTF8, b"[100000000000000000000000]", b"100000000000000000000000", b"-1", b"[-1]", b"1.5", DEEP,
            HUGE, b'{"ids": 5}', b"9" * 5000],
    "config.json": [*NOT_UTF8, b"{not json", DEEP, HUGE, b"[1, 2]", b'{"model_type": "llama", "auto_map": '
                    b'{"AutoConfig": "evil.Config"}}', b'{"model_type": "no-such-architecture"}', b"{}"],
    "adapter_config.json": [*NOT_UTF8, b"{not json", DEEP, b"[1]", b'{"r": 8}'],
}


def model_folder(tmp_path: Path) -> Path:
    """A folder export would read: a config.json of a real architecture, a run's config.yaml and state.json, no
    weights (nothing is loaded before the files are read)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def run_folder(tmp_path: Path) -> Path:
    """A training run's step_2/ checkpoint folder, its run's files next to it."""
    step = tmp_path / "run" / "step_2"
    (step / "model").mkdir(parents=True)
    (step / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (step / "config.yaml").write_text("model_name: m\n")
    (step / "state.json").write_text('{"step": 2}')
    return step


def inference_run(folder: Path) -> Path:
    """An inference.parquet of 6 examples with ids 0 to 5, for curate."""
    rng = np.random.default_rng(0)
    return write_inference_run(folder, rng.normal(size=(6, 4)), rng.uniform(1, 2, 6), [f"p{i}" for i in range(6)])


# (name, kind, where the file goes, the command line)
INPUTS = [
    ("train --config", "yaml", "c.yaml", lambda f, t: ["train", "--config", str(f)]),
    ("inference --config", "yaml", "c.yaml", lambda f, t: ["inference", "--config", str(f)]),
    ("generate --config", "yaml", "c.yaml", lambda f, t: ["generate", "--config", str(f)]),
    ("tokenizer --config", "yaml", "c.yaml", lambda f, t: ["tokenizer", "--config", str(f)]),
    ("generate --prompts-file", "text", "prompts.txt",
     lambda f, t: ["generate", "model_name=" + str(t / "no-model"), "--prompts-file", str(f)]),
    ("generate --prompts-file", "jsonl", "prompts.jsonl",
     lambda f, t: ["generate", "model_name=" + str(t / "no-model"), "--prompts-file", str(f)]),
    ("generate --messages", "json", "conversation.json",
     lambda f, t: ["generate", "model_name=" + str(t / "no-model"), "--messages", str(f)]),
    ("generate --messages", "jsonl", "conversations.jsonl",
     lambda f, t: ["generate", "model_name=" + str(t / "no-model"), "--messages", str(f)]),
    ("curate --include-ids", "ids", "ids.json",
     lambda f, t: ["curate", "--input", str(t / "inference"), "--output", str(t / "out"), "--include-ids", str(f)]),
    ("curate --exclude-ids", "ids", "ids.txt",
     lambda f, t: ["curate", "--input", str(t / "inference"), "--output", str(t / "out"), "--exclude-ids", str(f)]),
    ("eval --compare", "json", "results.json",
     lambda f, t: ["eval", "--model", str(t / "no-model"), "--tasks", "x", "--compare", str(f)]),
    ("export --from (config.json)", "config.json", "model/config.json",
     lambda f, t: ["export", "--from", str(f.parent), "--to", str(t / "out"), "--format", "gguf"]),
    ("export --from (adapter_config.json)", "adapter_config.json", "model/adapter_config.json",
     lambda f, t: ["export", "--from", str(f.parent), "--to", str(t / "out"), "--format", "hf"]),
    ("export --from (a run's config.yaml)", "yaml", "run/step_2/config.yaml",
     lambda f, t: ["export", "--from", str(f.parent), "--to", str(t / "out"), "--format", "hf"]),
    ("export --from (a run's state.json)", "json", "run/step_2/state.json",
     lambda f, t: ["export", "--from", str(f.parent), "--to", str(t / "out"), "--format", "hf"]),
]
CASES = [(name, kind, place, command, content) for name, kind, place, command in INPUTS for content in BAD[kind]]


@pytest.mark.parametrize("name, kind, place, command, content", CASES,
                         ids=[f"{name}-{i}" for i, (name, *_) in enumerate(CASES)])
def test_an_input_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, capsys, name, kind, place, command,
                                                                 content):
    model_folder(tmp_path)
    run_folder(tmp_path)
    inference_run(tmp_path / "inference")
    path = tmp_path / place
    path.write_bytes(content)
    before = snapshot(tmp_path)
    line = clean_failure(capsys, command(path, tmp_path))
    assert str(path) in line, line
    assert len(line) < 600 and snapshot(tmp_path) == before


def test_the_sweeps_selection_files_are_one_line(tmp_path, capsys):
    """The two cases the sweep met: a selection file with invalid UTF-8 (a UnicodeDecodeError traceback) and an id
    of 10^23 (an OverflowError traceback from NumPy)."""
    run = inference_run(tmp_path / "run")
    for content, says in [(b"\xff\xfe1\n2\n", ":1: not UTF-8 text (byte 0); re-encode the file as UTF-8"),
                          (b"[1, 100000000000000000000000]", ": ids are the records' index, from 0 to 2^63 - 1; got "
                                                             "100000000000000000000000")]:
        ids = tmp_path / "ids.json"
        ids.write_bytes(content)
        line = clean_failure(capsys, ["curate", "--input", str(run), "--output", str(tmp_path / "out"),
                                      "--include-ids", str(ids)])
        assert line == f"error: --include-ids {ids}{says}"
    assert not (tmp_path / "out").exists()


def test_a_config_json_naming_its_own_code_is_refused_before_export_loads_anything(tmp_path, capsys):
    folder = model_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "m.C"}}))
    assert clean_failure(capsys, ["export", "--from", str(folder), "--to", str(tmp_path / "o"), "--format",
                                  "gguf"]) == (
        f"error: --from {folder / 'config.json'}: the model names code of its own (auto_map), which this program "
        f"does not run; use a model whose architecture transformers has built in")


def test_a_metrics_file_with_a_bad_line_is_read_up_to_it(tmp_path):
    from gpt4all_training.tracking.tracker import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n[1]\n{"step": 2}\n')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_bytes(b'{"step": 1}\n{"step": \xff2}\n{"step": 3}\n')
    assert read_metrics(path) == [{"step": 1}]
