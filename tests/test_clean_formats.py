"""clean.py on the formats people bring besides JSON Lines of gpt4all, Dolly and chat records: Alpaca, TRL
prompt/completion (text and messages), JSON arrays, Parquet and CSV exports. Each file's report counts every unit:
`kept + dropped == read`, each drop under its reason, and what is kept is the exact record."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.files import read_jsonl, write_jsonl

from gpt4all_training.cli.main import main
from gpt4all_training.data.clean import clean
from gpt4all_training.errors import UserError

SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "Name a colour."}
RED = {"role": "assistant", "content": "Red."}
MORE = {"role": "user", "content": "Another?"}
BLUE = {"role": "assistant", "content": "Blue."}


def cleaned(tmp_path: Path, path: Path) -> tuple[dict, list[dict]]:
    """(the file's report entry, the records written), after checking that every unit is accounted for."""
    report = clean([str(path)], tmp_path / "out")
    entry = report["files"][str(path)]
    assert entry["kept"] + entry["dropped_total"] == entry["read"]
    return entry, read_jsonl(tmp_path / "out" / f"{path.stem}_clean.jsonl")


def test_alpaca_records_become_prompt_and_response(tmp_path):
    rows = [{"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
            {"instruction": "Name a prime.", "input": "", "output": "Seven."},
            {"instruction": "Say hi.", "input": None, "output": "Hi."},
            {"instruction": "No answer.", "input": ""},
            {"instruction": "Odd input.", "input": ["a"], "output": "x"}]
    entry, kept = cleaned(tmp_path, write_jsonl(tmp_path / "alpaca.jsonl", rows))
    assert kept == [{"source": "alpaca", "prompt": "Good morning\n\nTranslate to French.", "response": "Bonjour"},
                    {"source": "alpaca", "prompt": "Name a prime.", "response": "Seven."},
                    {"source": "alpaca", "prompt": "Say hi.", "response": "Hi."}]
    assert entry["dropped"] == {"missing_output": 1, "non_string_input": 1} and entry["read"] == 5


def test_trl_prompt_completion_as_text_and_as_messages(tmp_path):
    rows = [{"prompt": "The sky is", "completion": " blue."},
            {"prompt": [SYSTEM, ASK, RED, MORE], "completion": [BLUE]},
            {"prompt": [ASK], "completion": "Green."},
            {"prompt": "Is it good?", "completion": " No.", "label": False},
            {"prompt": "Nothing follows", "completion": None},
            {"prompt": [ASK], "completion": 3},
            {"prompt": [ASK], "completion": [MORE]}]
    entry, kept = cleaned(tmp_path, write_jsonl(tmp_path / "trl.jsonl", rows))
    assert kept == [{"source": "trl", "prompt": "The sky is", "response": " blue."},
                    {"messages": [SYSTEM, ASK, {**RED, "train": False}, MORE, BLUE], "source": "trl"},
                    {"messages": [ASK, {"role": "assistant", "content": "Green."}], "source": "trl"}]
    assert entry["dropped"] == {"unpaired_preference": 1, "missing_completion": 1, "malformed_messages": 1,
                                "last_turn_not_assistant": 1}


def test_a_json_array_and_json_lines_named_json(tmp_path):
    records = [{"instruction": "Name a prime.", "input": "", "output": "Seven."}, 3,
               {"messages": [ASK, RED], "source": "chat"}]
    array = tmp_path / "array.json"
    array.write_text("\ufeff" + json.dumps(records, indent=2), encoding="utf-8")
    entry, kept = cleaned(tmp_path, array)
    assert kept == [{"source": "array", "prompt": "Name a prime.", "response": "Seven."},
                    {"messages": [ASK, RED], "source": "chat"}]
    assert entry == {"lines": 3, "read": 3, "kept": 2, "dropped": {"not_an_object": 1}, "dropped_total": 1}

    lines = write_jsonl(tmp_path / "lines.json", [records[0], records[2]])
    assert cleaned(tmp_path, lines)[1] == [{"source": "lines", "prompt": "Name a prime.", "response": "Seven."},
                                           {"messages": [ASK, RED], "source": "chat"}]

    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "a", "response": "b"},\n  {"prompt": }\n]\n')
    with pytest.raises(UserError, match=rf"^{broken}:3:14: not valid JSON \(Expecting value\)"):
        clean([str(broken)], tmp_path / "broken-out")


def test_parquet_exports_of_chat_and_instruction_data(tmp_path):
    chat = [{"messages": [ASK, RED], "source": "hub"},
            {"messages": [SYSTEM, ASK, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": "{}"}}]},
                {"role": "tool", "content": "Red", "name": "pick", "tool_call_id": "c1"}, RED], "source": "hub"},
            {"messages": [ASK], "source": "hub"}]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")  # messages: structs with null fills
    entry, kept = cleaned(tmp_path, tmp_path / "chat.parquet")
    assert kept == chat[:2] and entry["dropped"] == {"last_turn_not_assistant": 1}

    dolly = [{"instruction": "Name a prime.", "context": "", "response": "Seven.", "category": "open_qa"},
             {"instruction": None, "context": "", "response": "x", "category": "open_qa"}]
    pq.write_table(pa.Table.from_pylist(dolly), tmp_path / "dolly.parquet", row_group_size=1)
    entry, kept = cleaned(tmp_path, tmp_path / "dolly.parquet")
    assert kept == [{"source": "open_qa", "prompt": "Name a prime.", "response": "Seven."}]
    assert entry == {"lines": 2, "read": 2, "kept": 1, "dropped": {"missing_instruction": 1}, "dropped_total": 1}

    (tmp_path / "fake.parquet").write_text('{"prompt": "a", "response": "b"}\n')
    with pytest.raises(UserError, match=rf"^{tmp_path / 'fake.parquet'}: not a readable Parquet file"):
        clean([str(tmp_path / "fake.parquet")], tmp_path / "fake-out")


def test_csv_and_tsv_rows_with_every_drop_counted(tmp_path):
    csv_file = tmp_path / "dolly.csv"
    csv_file.write_bytes(
        b"\xef\xbb\xbfinstruction,context,response,category\r\n"
        b'Name a prime.,,Seven.,open_qa\r\n'
        b'"Summarise, briefly.","Cats sleep.\r\nDogs bark.","Pets, in short.",summarization\r\n'
        b"\r\n"
        b"Too,many,fields,here,yes\r\n"
        b"Bad \xff byte,,x,open_qa\r\n"
        b"Last one.,,Yes.,open_qa")
    entry, kept = cleaned(tmp_path, csv_file)
    assert kept == [{"source": "open_qa", "prompt": "Name a prime.", "response": "Seven."},
                    {"source": "summarization", "prompt": "Cats sleep.\r\nDogs bark.\n\nSummarise, briefly.",
                     "response": "Pets, in short."},
                    {"source": "open_qa", "prompt": "Last one.", "response": "Yes."}]
    assert entry == {"lines": 6, "read": 6, "kept": 3, "dropped_total": 3,
                     "dropped": {"blank_line": 1, "invalid_utf8": 1, "wrong_field_count": 1}}

    tsv = tmp_path / "alpaca.tsv"
    tsv.write_text("instruction\tinput\toutput\nSay hi.\t\tHi.\n")
    assert cleaned(tmp_path, tsv)[1] == [{"source": "alpaca", "prompt": "Say hi.", "response": "Hi."}]


def test_rejects_number_csv_rows_by_the_line_they_start_on_and_array_elements_by_position(tmp_path):
    csv_file = tmp_path / "rows.csv"
    csv_file.write_bytes(b"instruction,context,response,category\r\n"
                         b'"Summarise,\r\nbriefly.","Cats sleep.\r\nDogs bark.",,summarization\r\n'
                         b"Too,many,fields,here,yes\r\n"
                         b"\r\n"
                         b"Bad \xff byte,,x,open_qa\r\n"
                         b"Name a prime.,,Seven.,open_qa\r\n")
    array = tmp_path / "items.json"
    array.write_text(json.dumps([{"prompt": "A?", "response": "a"}, ["not", "a", "record"], {"prompt": "A?",
                                                                                           "response": "a"}]))
    clean([str(csv_file), str(array)], tmp_path / "out", rejects=tmp_path / "rejects.jsonl")
    assert read_jsonl(tmp_path / "rejects.jsonl") == [
        {"file": str(csv_file), "line": 2, "reason": "empty_response",
         "record": {"instruction": "Summarise,\r\nbriefly.", "context": "Cats sleep.\r\nDogs bark.", "response": "",
                    "category": "summarization"}},
        {"file": str(csv_file), "line": 5, "reason": "wrong_field_count", "text": "Too,many,fields,here,yes"},
        {"file": str(csv_file), "line": 6, "reason": "blank_line", "text": ""},
        {"file": str(csv_file), "line": 7, "reason": "invalid_utf8", "text": "Bad \\xff byte,,x,open_qa"},
        {"file": str(array), "line": 2, "reason": "not_an_object", "text": '["not", "a", "record"]'},
        {"file": str(array), "line": 3, "reason": "duplicate", "record": {"prompt": "A?", "response": "a"}},
    ]


def test_a_csv_of_unknown_columns_is_named_as_such_not_as_invalid_json(tmp_path, capsys):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\nWhat?,That.\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["clean", str(data), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: clean: kept 0 of 1 records (unknown_format 1): 1 of them had the fields of none "
                           f"of the formats ({data}'s first line has the fields: question, answer)")
    assert "invalid_json" not in line and "Alpaca (instruction, input, output)" in line


def test_a_folder_holds_every_kind_and_not_clean_outputs(tmp_path):
    raw = tmp_path / "raw"
    write_jsonl(raw / "a.jsonl", [{"prompt": "A?", "response": "a"}])
    (raw / "b.json").write_text(json.dumps([{"prompt": "B?", "response": "b"}]))
    pq.write_table(pa.Table.from_pylist([{"prompt": "C?", "response": "c"}]), raw / "c.parquet")
    (raw / "d.csv").write_text("prompt,response\nD?,d\n")
    (raw / "notes.txt").write_text("not data\n")
    write_jsonl(raw / "old_clean.jsonl", [{"prompt": "E?", "response": "e"}])
    (raw / "clean_report.json").write_text("{}")
    report = clean([str(raw)], raw)
    assert sorted(Path(name).name for name in report["files"]) == ["a.jsonl", "b.json", "c.parquet", "d.csv"]
    assert report["total"] == {"lines": 4, "read": 4, "kept": 4}


def test_a_folder_named_like_a_data_file_in_an_input_folder_is_one_line(tmp_path):
    write_jsonl(tmp_path / "raw" / "a.jsonl", [{"prompt": "A?", "response": "a"}])
    (tmp_path / "raw" / "b.jsonl").mkdir()
    with pytest.raises(UserError, match=rf"^{tmp_path / 'raw' / 'b.jsonl'}: a folder named like a data file; rename "
                                        rf"it or move it out of {tmp_path / 'raw'}$"):
        clean([str(tmp_path / "raw")], tmp_path / "out")
