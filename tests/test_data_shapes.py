"""A folder of clean files of several shapes tokenises each record as its own file alone would: a record's shape
decides its path (prompt/response by the prompt template, conversations by the chat template), the other records
never do. Truncation keeps the answer in both paths, and what is dropped is counted per source file.

The files are built from small slices of the shared samples: Alpaca JSONL and a CSV from Dolly, ShareGPT from
OpenAssistant's best threads, gpt4all prompt/response records (with a broken line, which clean.py drops), all
cleaned by clean.py into one folder, and each on its own into a folder of its own.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from support.files import write_jsonl
from support.paths import DOLLY, OASST

from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.clean import clean
from gpt4all_training.data.conversations import oasst_threads
from gpt4all_training.data.prompts import resolve_template
from gpt4all_training.data.records import load_records, record_sources
from gpt4all_training.data.sft import load_data, tokenize_dataset

MAX_LENGTH = 96
SHAREGPT_FROM = {"user": "human", "assistant": "gpt"}


def dolly_rows(start: int, count: int) -> list[dict]:
    with open(DOLLY, encoding="utf-8") as f:
        return [json.loads(line) for line in f][start:start + count]


def sharegpt_rows(count: int) -> list[dict]:
    rows = []
    with open(OASST, encoding="utf-8") as f:
        for line, _ in zip(f, range(count)):
            [thread] = oasst_threads(json.loads(line), "best")
            rows.append({"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in thread]})
    return rows


def write_raw_files(folder: Path) -> list[Path]:
    """The four raw files, each a different slice of the samples (so clean.py finds no duplicate across them)."""
    alpaca = write_jsonl(folder / "a_alpaca.jsonl", [{"instruction": r["instruction"], "input": r["context"],
                                                      "output": r["response"]} for r in dolly_rows(0, 24)])
    with open(folder / "b_dolly.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "context", "response", "category"])
        writer.writeheader()
        writer.writerows(dolly_rows(24, 24))
    sharegpt = write_jsonl(folder / "c_sharegpt.jsonl", sharegpt_rows(12))
    pairs = [{"prompt": f"{r['context']}\n\n{r['instruction']}", "response": r["response"], "source": "gpt4all"}
             for r in dolly_rows(48, 24)]
    gpt4all = write_jsonl(folder / "d_gpt4all.jsonl", pairs)
    with open(gpt4all, "a", encoding="utf-8") as f:
        f.write('{"prompt": "cut off in the mid\n')
    return [alpaca, folder / "b_dolly.csv", sharegpt, gpt4all]


def per_record(dataset_path: Path, tokenizer) -> list[tuple]:
    """(the record's file name, input ids, labels, drop reason, truncated prompt, truncated response) of every
    record, in load order."""
    records = load_records(str(dataset_path))
    template = resolve_template("auto", tokenizer)
    tokenized = tokenize_dataset(records, tokenizer, MAX_LENGTH, template, None)
    names = [Path(name).name for name, count in record_sources(str(dataset_path)) for _ in range(count)]
    return [(name, row["input_ids"], row["labels"], row["drop_reason"], row["truncated_prompt"],
             row["truncated_response"]) for name, row in zip(names, tokenized)]


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory) -> tuple[Path, list[Path]]:
    """(the folder clean.py wrote from all four files, the folders it wrote from each alone)."""
    root = tmp_path_factory.mktemp("shapes")
    raw = write_raw_files(root / "raw")
    clean([str(root / "raw")], root / "together")
    alone = []
    for path in raw:
        clean([str(path)], root / path.stem)
        alone.append(root / path.stem)
    return root / "together", alone


def test_a_folder_of_mixed_shapes_tokenises_every_record_as_its_file_alone(cleaned, chat_tokenizer):
    together, alone = cleaned
    mixed = per_record(together, chat_tokenizer)
    each = [row for folder in alone for row in per_record(folder, chat_tokenizer)]
    assert [name for name, *_ in mixed] == [name for name, *_ in each]
    assert len(mixed) == 24 + 24 + 12 + 24
    for got, want in zip(mixed, each):
        assert got == want, got[0]
    # The data exercises truncation in every file, and every record is trained on: no answer is cut away.
    for prefix in ("a_", "b_", "c_", "d_"):
        assert sum(row[4] for row in mixed if row[0].startswith(prefix)) >= 5, prefix
    assert [row[3] for row in mixed] == [""] * len(mixed)


def test_what_is_dropped_is_counted_per_source_file(tmp_path, chat_tokenizer):
    write_jsonl(tmp_path / "a_clean.jsonl", [{"source": "a", "prompt": "Name a colour.", "response": "Red."},
                                             {"source": "a", "prompt": "Say nothing.", "response": ""}])
    write_jsonl(tmp_path / "b_clean.jsonl", [
        {"messages": [{"role": "user", "content": "Hi."}], "source": "b"},
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], "source": "b"},
        {"source": "b", "prompt": "Say nothing again.", "response": " "}])
    config = validate(TrainConfig(model_name="m", dataset_path=str(tmp_path), val_fraction=0.0, num_proc=1,
                                  max_length=64))
    (train, _), (stats, _) = load_data(config, chat_tokenizer)
    assert sorted(train["index"]) == [0, 3]
    assert stats.dropped == {"empty_response": 2, "last_turn_not_assistant": 1}
    assert stats.dropped_by_file == {"a_clean.jsonl": {"empty_response": 1},
                                     "b_clean.jsonl": {"empty_response": 1, "last_turn_not_assistant": 1}}
    assert "dropped empty_response 2 (a_clean.jsonl 1, b_clean.jsonl 1), last_turn_not_assistant 1 " \
           "(b_clean.jsonl 1);" in stats.describe("train")
