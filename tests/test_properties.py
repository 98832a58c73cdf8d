"""Property-based tests of the three entry points that take arbitrary input: clean.py (bytes and JSON),
tokenisation with labels (data.tokenize_batch, with the real fixture tokenizer) and config loading (YAML).

Every property runs with a fixed seed (derandomize) and a bounded number of examples, and keeps no example
database, so CI runs the same cases every time; together they take well under a minute on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpt4all_training import cli
from gpt4all_training.data.clean import Filters, clean_file
from gpt4all_training.config.fields import shown
from gpt4all_training.config.loader import config_fields, load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.sft import finish_split, tokenize_batch, tokenize_dataset
from gpt4all_training.errors import UserError


def bounded(max_examples: int):
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# Any encodable character (lone surrogates are their own cases below), awkward ones on purpose, and text far longer
# than any max_length used here.
CHARACTERS = st.characters(codec=None, exclude_categories=("Cs",))
AWKWARD = st.sampled_from(["", " ", "\t", "\n", "\r\n", "\x00", "\x07", "\x1b[31m", "\x7f", "\u0085", "\u2028",
                           "\ufeff", "\u200b", "e\u0301", "\U0001f600", "\u202e", "\\", '"', "\ud7ff", "\uffff"])
TEXT = st.one_of(
    st.text(CHARACTERS, max_size=30),
    st.lists(AWKWARD, max_size=6).map("".join),
    st.text(CHARACTERS, min_size=1, max_size=4).map(lambda s: s * 80),  # 80-320 characters
)


# ---------------------------------------------------------------- clean.py

FIELDS = st.sampled_from(["prompt", "response", "source", "instruction", "context", "category", "message_tree_id",
                          "role", "text", "replies", "deleted", "value", "description"])
SURROGATE_TEXT = st.text(st.characters(codec=None, categories=("Cs", "Ll")), max_size=4)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT | SURROGATE_TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(FIELDS | st.text(max_size=4), children,
                                                                      max_size=5),
    max_leaves=24)


def encode_line(value, ascii_only: bool) -> bytes:
    # A lone surrogate: escaped as \udXXX (valid JSON, no UTF-8 file can hold it), or raw (invalid UTF-8 bytes).
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def lines_of(content: bytes) -> int:
    return content.count(b"\n") + (1 if content and not content.endswith(b"\n") else 0)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One folder, rewritten by every example."""
    return tmp_path_factory.mktemp("properties")


def clean_bytes(work: Path, content: bytes):
    source = work / "input.jsonl"
    source.write_bytes(content)
    report = clean_file(source, work / "input_clean.jsonl", Filters(), set())
    # Lines end at "\n" only: str.splitlines would also cut at U+0085 or U+2028, which clean.py writes unescaped.
    with open(work / "input_clean.jsonl", encoding="utf-8", newline="") as f:
        rows = [json.loads(line) for line in f]
    return report, rows


def assert_accounted(content: bytes, report, rows) -> None:
    assert report.lines == lines_of(content)
    assert report.read >= report.lines  # every line is at least one record, kept or dropped
    assert report.kept + sum(report.dropped.values()) == report.read
    assert len(rows) == report.kept
    assert all(set(row) == {"source", "prompt", "response"} and all(isinstance(v, str) for v in row.values())
               for row in rows)


@pytest.mark.slow
@bounded(400)
@given(st.lists(st.one_of(st.binary(max_size=60), st.tuples(JSON_VALUES, st.booleans()).map(
    lambda pair: encode_line(*pair))), max_size=8).map(b"\n".join))
@example(b"\xef\xbb\xbf{\"prompt\": \"ab\", \"response\": \"c\"}\r\n\xff\xfe\n\n[" * 3 + b"[" * 100_000)
def test_clean_never_crashes_on_arbitrary_bytes(work, content):
    report, rows = clean_bytes(work, content)
    assert_accounted(content, report, rows)


@pytest.mark.slow
@bounded(300)
@given(st.lists(st.one_of(
    st.tuples(st.just("any"), JSON_VALUES),
    st.tuples(st.just("valid"), st.tuples(TEXT, TEXT.filter(str.strip))),
), max_size=10), st.booleans(), st.booleans())
def test_clean_keeps_valid_records_unchanged_among_arbitrary_json(work, lines, ascii_only, crlf):
    """A gpt4all record with a real prompt and a non-blank response comes out exactly as it went in, whatever
    arbitrary JSON surrounds it. Each one's prompt ends in a unique "#i" and its source is "valid:i", so none is a
    duplicate of another and it can be picked out of the output."""
    encoded, expected = [], []
    for i, (kind, value) in enumerate(lines):
        if kind == "valid":
            value = {"prompt": f"{value[0]} #{i}", "response": value[1], "source": f"valid:{i}"}
            expected.append({"source": value["source"], "prompt": value["prompt"], "response": value["response"]})
        encoded.append(encode_line(value, ascii_only))
    content = b"".join(line + (b"\r\n" if crlf else b"\n") for line in encoded)
    report, rows = clean_bytes(work, content)
    assert_accounted(content, report, rows)
    assert [row for row in rows if row["source"].startswith("valid:")] == expected


# ---------------------------------------------------------------- tokenisation and labels

# A Hub dataset can hold nulls and numbers where text belongs; a Python caller can pass lone surrogates.
ROW_VALUE = TEXT | SURROGATE_TEXT | st.none() | st.integers()


def check_row(row: dict, prompt, response, tokenizer, max_length: int) -> None:
    ids, labels = row["input_ids"], row["labels"]
    eos = tokenizer.eos_token_id
    assert len(ids) == len(labels) == row["length"] <= max_length
    # The Hugging Face convention (the model shifts): a trained position holds its own input id.
    assert all(label == IGNORE or label == token for label, token in zip(labels, ids))
    assert labels[0] == IGNORE  # nothing predicts the first token
    trained = [label for label in labels if label != IGNORE]
    assert row["n_trained"] == len(trained)
    first = next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))
    assert all(label != IGNORE for label in labels[first:])  # masked prompt, then the trained response
    if row["n_trained"] == 0:
        assert row["drop_reason"]  # nothing to learn: dropped and counted, never trained on
    if row["drop_reason"] == "":
        assert isinstance(prompt, str) and isinstance(response, str) and row["n_trained"] >= 1
    if any(isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text) for text in (prompt, response)):
        assert row["drop_reason"] in ("missing_prompt", "missing_response", "invalid_unicode")
        return
    # The EOS rule: EOS is the last label exactly when the response was not cut, and nowhere else.
    assert (trained[-1:] == [eos]) == (not row["truncated_response"])
    assert eos not in trained[:-1]
    if isinstance(response, str):
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        if row["truncated_response"]:
            assert trained == response_ids[:len(trained)] and len(trained) < len(response_ids) + 1
        elif len(trained) == len(response_ids) + 1:
            assert trained == response_ids + [eos]


@bounded(500)
@given(rows=st.lists(st.tuples(ROW_VALUE, ROW_VALUE), min_size=1, max_size=4), max_length=st.integers(2, 64))
@example(rows=[("", ""), (" ", " "), ("\x00", "\n"), ("q" * 500, "a" * 500)], max_length=2)
def test_labels_follow_the_rules_for_any_text(tokenizer, rows, max_length):
    """With the session tokenizer (byte-level BPE, EOS id 0, no BOS) and the plain template."""
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    out = tokenize_batch({"prompt": prompts, "response": responses}, tokenizer, max_length, "plain")
    assert all(len(column) == len(rows) for column in out.values())
    for i, (prompt, response) in enumerate(rows):
        check_row({key: column[i] for key, column in out.items()}, prompt, response, tokenizer, max_length)


@bounded(12)
@given(rows=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=12), max_length=st.integers(2, 24))
def test_every_example_is_kept_or_counted_as_dropped(tokenizer, rows, max_length):
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "response": [r for _, r in rows]})
    kept, stats = finish_split(tokenize_dataset(ds, tokenizer, max_length, "plain", None))
    assert stats.count == len(kept) and len(kept) + sum(stats.dropped.values()) == len(rows)
    assert all(n >= 1 for n in kept["n_trained"])
    assert set(stats.dropped) <= {"empty_response", "no_trained_tokens"}


def test_lone_surrogate_is_dropped_by_tokenize_batch(tokenizer):
    out = tokenize_batch({"prompt": ["a\ud800b"], "response": ["fine"]}, tokenizer, 16, "plain")
    assert out["drop_reason"] == ["invalid_unicode"]


def test_lone_surrogates_never_reach_tokenization(tmp_path):
    from gpt4all_training.data.records import load_records

    (tmp_path / "s_clean.jsonl").write_text('{"prompt": "a\\ud800b", "response": "ok"}\n')
    with pytest.raises(UserError) as error:
        load_records(str(tmp_path))
    assert str(error.value) == (f"{tmp_path / 's_clean.jsonl'}:1: text with a lone surrogate, which is not valid "
                                f"Unicode; run clean.py on it first")
    report, rows = clean_bytes(tmp_path, b'{"prompt": "a\\ud800b", "response": "ok"}\n')
    assert (dict(report.dropped), rows) == ({"invalid_unicode": 1}, [])


def test_special_token_text_in_a_response_is_not_an_eos(tokenizer):
    out = tokenize_batch({"prompt": ["Quote it."], "response": ["It says <|endoftext|> here."]}, tokenizer, 64,
                         "plain")
    trained = [label for label in out["labels"][0] if label != IGNORE]
    assert trained.count(tokenizer.eos_token_id) == 1


# ---------------------------------------------------------------- config loading

FIELD_NAMES = sorted(config_fields(TrainConfig))
YAML_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | TEXT
                | st.sampled_from(["5e-5", "1e3", "yes", "off", "~", ".nan", "-.inf", "0x10", "12:30"]))
YAML_VALUES = st.recursive(YAML_SCALARS, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=8)
YAML_DOCUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8) | st.integers(), YAML_VALUES, max_size=6)
    .map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
    YAML_VALUES.map(lambda v: yaml.safe_dump(v, allow_unicode=True)),
    st.lists(CHARACTERS | AWKWARD, max_size=40).map("".join),  # mostly not YAML at all
)


@pytest.mark.slow
@bounded(300)
@given(text=YAML_DOCUMENTS)
@example(text="[" * 5000)  # nested deeper than Python's recursion limit
@example(text='"two\\nlines": 1\n')  # a key that would break the error line
@example(text=f"{'k' * 5000}: 1\n")
@example(text="report_to: [&a [x, x, x, x, x, x, x, x], &b [*a, *a, *a, *a, *a, *a, *a, *a], &c [*b, *b, *b, *b, *b, "
              "*b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c], [*d, *d, *d, *d, *d, *d, *d, *d]]\n")  # 37k from 40
def test_any_yaml_loads_or_is_one_line_naming_a_key_or_the_file(work, text, capsys):
    path = work / "config.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        config = load_config(path, ["model_name=m", "dataset_path=d"])
    except UserError as exc:
        message = str(exc)
    else:
        assert isinstance(config, TrainConfig)
        return
    assert "\n" not in message and "\r" not in message and len(message) < 600
    document = yaml.safe_load(text) if not message.startswith(f"config {path}:") else None
    keys = [*FIELD_NAMES, *(document if isinstance(document, dict) else [])]
    assert message.startswith(f"config {path}:") or \
        any(message.startswith(f"{form}: ") for key in keys for form in (str(key), shown(key)))
    # The CLI prints that one line and exits 2, before anything else runs.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(path), "model_name=m", "dataset_path=d"])
    assert exit_info.value.code == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")
