"""clean.py on the two real samples (used by path) and on a hand-made file that holds every drop reason.

tests/data/malformed.jsonl, line by line: a kept gpt4all record behind a BOM with CRLF; a kept record whose prompt and
response are wrapped in {"value"} / {"description"}; an empty line; a whitespace line with CRLF; two lines of invalid
UTF-8; broken JSON; three JSON values that are not objects; an object of no known format; gpt4all records missing or
null in a field, or with non-string fields; a one-character and a blank prompt; a blank response; a whitespace-variant
duplicate of the first line; a lone-surrogate escape; four Dolly records (one kept, null instruction, list context,
no response); four OpenAssistant trees (one with two kept pairs, a deleted answer with a pair below it, a message
without text and a non-message reply; one with no pairs; one without a root; one with an unknown role); three kept
records that the optional filters drop (an AI disclaimer, a refusal, a one-letter answer); and a last line with no
newline and a non-string source.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from support.files import write_jsonl
from support.paths import DOLLY, OASST, PYTHON, REPO

from gpt4all_training.data.clean import Filters, clean
from gpt4all_training.errors import UserError

MALFORMED = REPO / "tests" / "data" / "malformed.jsonl"

MALFORMED_DROPPED = {
    "blank_line": 2, "deleted_message": 2, "duplicate": 1, "empty_response": 1, "invalid_json": 1,
    "invalid_unicode": 1, "invalid_utf8": 2, "malformed_message": 3, "missing_instruction": 1, "missing_prompt": 3,
    "missing_response": 2, "no_pairs": 1, "non_string_context": 1, "non_string_prompt": 1, "non_string_response": 2,
    "not_an_object": 3, "short_prompt": 2, "unknown_format": 1,
}
MALFORMED_KEPT = [
    {"source": "hand", "prompt": "What colour is a clear daytime sky?", "response": "Blue."},
    {"source": "malformed", "prompt": "Name a prime number above ten.", "response": "Eleven."},
    {"source": "summarization", "prompt": "Cats sleep a lot. Dogs bark.\n\nSummarise the passage.",
     "response": "Pets have habits."},
    {"source": "oasst", "prompt": "How do plants make food?", "response": "By photosynthesis."},
    {"source": "oasst", "prompt": "User: How do plants make food?\nAssistant: By photosynthesis.\n\n"
                                  "What do they need for it?", "response": "Light, water and carbon dioxide."},
    {"source": "hand", "prompt": "Are you a person?", "response": "As an AI language model, I have no body."},
    {"source": "hand", "prompt": "Tell me a secret.", "response": "I'm sorry, but I cannot help with that."},
    {"source": "hand", "prompt": "Reply with one letter.", "response": "K"},
    {"source": "malformed", "prompt": "Is the last line read without a newline?", "response": "Yes."},
]


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def walk_oasst(path: Path):
    """(depth, role, text) of every message in every tree, for an independent count of pairs."""
    for line in path.read_text(encoding="utf-8").splitlines():
        stack = [(json.loads(line)["prompt"], 0)]
        while stack:
            message, depth = stack.pop()
            yield depth, message["role"], message["text"]
            stack.extend((reply, depth + 1) for reply in message["replies"])


# ---------------------------------------------------------------- the real samples

def test_dolly_keeps_every_line(tmp_path):
    report = clean([str(DOLLY)], tmp_path)
    assert report["files"][str(DOLLY)] == {"lines": 619, "read": 619, "kept": 619, "dropped": {},
                                           "dropped_total": 0}
    assert json.loads((tmp_path / "clean_report.json").read_text()) == report
    records = read_jsonl(tmp_path / "dolly-sample_clean.jsonl")
    assert all(list(record) == ["source", "prompt", "response"] for record in records)
    # The sample's README counts its categories; each becomes the record's source.
    assert Counter(record["source"] for record in records) == {
        "open_qa": 136, "general_qa": 102, "classification": 79, "closed_qa": 77, "brainstorming": 75,
        "information_extraction": 74, "summarization": 55, "creative_writing": 21}
    originals = read_jsonl(DOLLY)
    with_context = [(o, r) for o, r in zip(originals, records) if o["context"]]
    assert len(with_context) == 206
    # Context first and the instruction last: truncation keeps a prompt's end, where the question is.
    assert all(r["prompt"] == f"{o['context']}\n\n{o['instruction']}" for o, r in with_context)
    assert all(r["prompt"] == o["instruction"] for o, r in zip(originals, records) if not o["context"])
    assert [r["response"] for r in records] == [o["response"] for o in originals]


def test_oasst_pairs_give_one_record_per_prompter_assistant_pair(tmp_path):
    report = clean([str(OASST)], tmp_path, oasst="pairs")
    assert report["files"][str(OASST)] == {"lines": 100, "read": 687, "kept": 687, "dropped": {},
                                           "dropped_total": 0}
    records = read_jsonl(tmp_path / "oasst-sample_clean.jsonl")
    messages = list(walk_oasst(OASST))
    # Every assistant reply is an answer to a prompter message (the README's 687 pairs), kept once each.
    assert Counter(r["response"] for r in records) == Counter(text for _, role, text in messages if role == "assistant")
    # Replies below the first exchange carry the thread above them as context.
    deep_replies = sum(1 for depth, role, _ in messages if role == "assistant" and depth >= 3)
    assert deep_replies == sum(1 for r in records if r["prompt"].startswith("User: "))
    assert deep_replies > 0


@pytest.mark.parametrize("filters, dolly_dropped, oasst_dropped", [
    (Filters(drop_ai_disclaimers=True), {}, {"ai_disclaimer": 9}),
    (Filters(drop_refusals=True), {}, {"refusal": 19}),
    (Filters(min_response_chars=20), {"short_response": 41}, {"short_response": 4}),
    (Filters(drop_ai_disclaimers=True, drop_refusals=True), {}, {"ai_disclaimer": 9, "refusal": 18}),
], ids=["ai-disclaimers", "refusals", "min-response-chars", "both"])
def test_optional_filters_count_their_drops(tmp_path, filters, dolly_dropped, oasst_dropped):
    report = clean([str(DOLLY), str(OASST)], tmp_path, filters, oasst="pairs")
    for path, read, dropped in ((DOLLY, 619, dolly_dropped), (OASST, 687, oasst_dropped)):
        entry = report["files"][str(path)]
        assert entry["dropped"] == dropped
        assert entry["kept"] == read - sum(dropped.values())


# ---------------------------------------------------------------- the malformed file

def test_malformed_file_counts_every_reason(tmp_path):
    report = clean([str(MALFORMED)], tmp_path, oasst="pairs")
    entry = report["files"][str(MALFORMED)]
    assert entry["dropped"] == MALFORMED_DROPPED
    assert (entry["lines"], entry["read"], entry["kept"], entry["dropped_total"]) == (34, 39, 9, 30)
    assert entry["kept"] + entry["dropped_total"] == entry["read"]
    assert read_jsonl(tmp_path / "malformed_clean.jsonl") == MALFORMED_KEPT


def test_malformed_file_with_every_filter(tmp_path):
    report = clean([str(MALFORMED)], tmp_path, Filters(True, True, 2), oasst="pairs")
    entry = report["files"][str(MALFORMED)]
    assert entry["dropped"] == {**MALFORMED_DROPPED, "ai_disclaimer": 1, "refusal": 1, "short_response": 1}
    assert (entry["read"], entry["kept"], entry["dropped_total"]) == (39, 6, 33)
    assert read_jsonl(tmp_path / "malformed_clean.jsonl") == MALFORMED_KEPT[:5] + MALFORMED_KEPT[8:]


# Every record the malformed file loses, as --rejects writes it: (line, reason), in the order read.
MALFORMED_REJECTS = [
    (3, "blank_line"), (4, "blank_line"), (5, "invalid_utf8"), (6, "invalid_utf8"), (7, "invalid_json"),
    (8, "not_an_object"), (9, "not_an_object"), (10, "not_an_object"), (11, "unknown_format"), (12, "missing_prompt"),
    (13, "missing_response"), (14, "missing_prompt"), (15, "non_string_prompt"), (16, "non_string_response"),
    (17, "non_string_response"), (18, "short_prompt"), (19, "short_prompt"), (20, "empty_response"),
    (21, "duplicate"), (22, "invalid_unicode"), (24, "missing_instruction"), (25, "non_string_context"),
    (26, "missing_response"), (27, "malformed_message"), (27, "deleted_message"), (27, "deleted_message"),
    (27, "malformed_message"), (28, "no_pairs"), (29, "missing_prompt"), (30, "malformed_message"),
]


def test_rejects_names_every_dropped_line_with_its_reason(tmp_path):
    report = clean([str(MALFORMED)], tmp_path / "out", oasst="pairs", rejects=tmp_path / "rejects" / "r.jsonl")
    assert report["rejects"] == str(tmp_path / "rejects" / "r.jsonl")
    rejects = read_jsonl(tmp_path / "rejects" / "r.jsonl")
    assert [(r["line"], r["reason"]) for r in rejects] == MALFORMED_REJECTS
    assert Counter(r["reason"] for r in rejects) == MALFORMED_DROPPED
    assert {r["file"] for r in rejects} == {str(MALFORMED)}
    lines = MALFORMED.read_bytes().split(b"\n")
    by_line = {r["line"]: r for r in rejects}
    # A line that holds no record comes back as its text (bytes that are not UTF-8 as escapes), one that does as
    # the record read from it.
    assert by_line[4] == {"file": str(MALFORMED), "line": 4, "reason": "blank_line", "text": "   \t"}
    assert by_line[6]["text"] == "\\xff\\xfe{}"
    assert by_line[7]["text"] == lines[6].decode()
    assert by_line[21] == {"file": str(MALFORMED), "line": 21, "reason": "duplicate", "record": json.loads(lines[20])}
    assert by_line[22]["record"]["prompt"] == "A lone surrogate \ud800 here"
    assert all(r["record"] == json.loads(lines[r["line"] - 1]) for r in rejects if "record" in r)


def test_rejects_is_refused_where_it_would_be_read_as_data(tmp_path):
    write_jsonl(tmp_path / "raw" / "a.jsonl", [{"prompt": "Hi there", "response": "Hello."}])
    for path, words in [(tmp_path / "raw" / "a.jsonl", "it would be read as an input"),
                        (tmp_path / "raw" / "rejects.jsonl", "it would be read as an input"),
                        (tmp_path / "out" / "rejects_clean.jsonl", "training reads every *_clean.jsonl")]:
        with pytest.raises(UserError, match=rf"^--rejects {path}: {re.escape(words)}"):
            clean([str(tmp_path / "raw")], tmp_path / "out", rejects=path)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- files in, files out

def test_inputs_are_never_modified(tmp_path):
    local = tmp_path / "data"
    local.mkdir()
    (local / "malformed.jsonl").write_bytes(MALFORMED.read_bytes())
    inputs = [DOLLY, OASST, local / "malformed.jsonl"]
    before = [sha256(path) for path in inputs]
    clean([str(DOLLY), str(OASST)], tmp_path / "out", Filters(True, True, 5))
    clean([str(local)], local)  # output next to the input
    clean([str(local)], local)  # a rerun on the folder skips the *_clean.jsonl it wrote
    assert [sha256(path) for path in inputs] == before
    assert sorted(p.name for p in local.iterdir()) == ["clean_report.json", "malformed.jsonl", "malformed_clean.jsonl"]


def test_folder_input_and_duplicates_across_files(tmp_path):
    rows = [{"prompt": "Name a colour.", "response": "Red."}, {"prompt": "Name a fruit.", "response": "Apple."}]
    write_jsonl(tmp_path / "in" / "a.jsonl", rows)
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"prompt": "Name a  colour.", "response": "Red. "}])
    report = clean([str(tmp_path / "in")], tmp_path / "out")
    assert report["files"][str(tmp_path / "in" / "a.jsonl")]["kept"] == 2
    assert report["files"][str(tmp_path / "in" / "b.jsonl")]["dropped"] == {"duplicate": 1}
    assert report["total"] == {"lines": 3, "read": 3, "kept": 2, "dropped:duplicate": 1}
    assert read_jsonl(tmp_path / "out" / "a_clean.jsonl")[0] == {"source": "a", **rows[0]}
    assert read_jsonl(tmp_path / "out" / "b_clean.jsonl") == []


def test_two_inputs_with_one_output_name_are_refused(tmp_path):
    for folder in ("x", "y"):
        write_jsonl(tmp_path / folder / "data.jsonl", [{"prompt": "Hi there", "response": "Hello."}])
    with pytest.raises(UserError, match="would overwrite the output of"):
        clean([str(tmp_path / "x" / "data.jsonl"), str(tmp_path / "y" / "data.jsonl")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_input_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        clean([str(tmp_path / "nothing.jsonl")], tmp_path / "out")


@pytest.mark.integration
def test_interrupted_run_leaves_the_previous_output_whole(tmp_path):
    """The input is a pipe, so the run can be stopped while it is provably midway through writing its output."""
    fifo, out = tmp_path / "data.jsonl", tmp_path / "out"
    os.mkfifo(fifo)
    out.mkdir()
    (out / "data_clean.jsonl").write_text("previous complete output\n")
    # Ctrl-C's default restored in the child: a suite started in the background (`.ci/run &`) passes SIGINT on
    # ignored, and Python then never turns it into KeyboardInterrupt.
    process = subprocess.Popen([PYTHON, "clean.py", str(fifo), "--output-dir", str(out)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        with open(fifo, "w", encoding="utf-8") as writer:  # blocks until clean.py opens the pipe
            for i in range(2000):
                writer.write(json.dumps({"prompt": f"Question number {i}?", "response": f"Answer {i}."}) + "\n")
            writer.flush()
            temporary = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # wait until part of the output is on disk
                temporary = [p for p in out.iterdir() if p.name.endswith(".tmp") and p.stat().st_size > 0]
                if temporary:
                    break
                time.sleep(0.02)
            assert temporary, "clean.py never started writing"
            assert (out / "data_clean.jsonl").read_text() == "previous complete output\n"
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert (process.returncode, stderr) == (130, "interrupted\n")
    assert sorted(p.name for p in out.iterdir()) == ["data_clean.jsonl"]  # no temporary file, no report
    assert (out / "data_clean.jsonl").read_text() == "previous complete output\n"


@pytest.mark.integration
def test_script_prints_the_counts(tmp_path):
    result = subprocess.run([PYTHON, "clean.py", str(DOLLY), str(MALFORMED), "--output-dir", str(tmp_path),
                             "--drop-refusals", "--oasst", "pairs"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted({**MALFORMED_DROPPED, "refusal": 1}.items()))
    assert result.stdout.splitlines() == [
        f"{DOLLY}: lines 619, read 619, kept 619, dropped 0 (none)",
        f"{MALFORMED}: lines 34, read 39, kept 8, dropped 31 ({reasons})",
        f"report: {tmp_path / 'clean_report.json'}",
    ]


@pytest.mark.integration
def test_script_prints_each_file_as_given_and_writes_the_rejects(tmp_path):
    """A relative name is printed as typed (`my_data.jsonl`, not resolved or re-cased), and --rejects says where the
    dropped records went and how many."""
    (tmp_path / "my_data.jsonl").write_bytes(MALFORMED.read_bytes())
    result = subprocess.run([PYTHON, str(REPO / "clean.py"), "my_data.jsonl", "--output-dir", "out", "--rejects",
                             "rejects.jsonl", "--oasst", "pairs"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(MALFORMED_DROPPED.items()))
    assert result.stdout.splitlines() == [
        f"my_data.jsonl: lines 34, read 39, kept 9, dropped 30 ({reasons})",
        "report: out/clean_report.json",
        "rejects: rejects.jsonl (30 records)",
    ]
    rejects = read_jsonl(tmp_path / "rejects.jsonl")
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [("my_data.jsonl", *r) for r in MALFORMED_REJECTS]
