"""Property-based tests of the entry points that take arbitrary input: clean.py (bytes and JSON), tokenisation with
labels (data.tokenize_batch, with the real fixture tokenizer), config loading (YAML, training and inference),
inference's records and per-example maths, and build_map's reader of inference.parquet.

Every property runs with a fixed seed (derandomize) and a bounded number of examples, and keeps no example
database, so CI runs the same cases every time; together they take well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpt4all_training import cli
from gpt4all_training.analysis.inference import example_losses, load_examples, pool_hidden
from gpt4all_training.analysis.map.runs import load_run
from gpt4all_training.data.clean import Filters, clean_file
from gpt4all_training.config.fields import shown
from gpt4all_training.config.loader import config_fields, load_config
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
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


# ---------------------------------------------------------------- inference: its config, its maths, its records

INFERENCE_FIELDS = sorted(config_fields(InferenceConfig))
INFERENCE_DOCUMENTS = st.dictionaries(st.sampled_from(INFERENCE_FIELDS) | st.text(max_size=8), YAML_VALUES,
                                      max_size=6).map(lambda d: yaml.safe_dump(d, allow_unicode=True))


@pytest.mark.slow
@bounded(200)
@given(text=INFERENCE_DOCUMENTS | YAML_DOCUMENTS)
@example(text="output_dir: ''\n")
@example(text="batch_size: 8\nbatch_size: 16\n")
def test_any_yaml_is_an_inference_config_or_one_line_naming_a_key_or_the_file(work, text, capsys):
    path = work / "inference.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        config = load_config(path, ["model_name=m", "dataset_path=d"], cls=InferenceConfig)
    except UserError as exc:
        message = str(exc)
    else:
        assert isinstance(config, InferenceConfig) and config.output_dir.strip() and config.batch_size >= 1
        return
    assert "\n" not in message and "\r" not in message and len(message) < 600
    document = yaml.safe_load(text) if not message.startswith(f"config {path}:") else None
    keys = [*INFERENCE_FIELDS, *(document if isinstance(document, dict) else [])]
    assert message.startswith(f"config {path}:") or \
        any(message.startswith(f"{form}: ") for key in keys for form in (str(key), shown(key)))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inference", "--config", str(path), "model_name=m", "dataset_path=d"])
    assert exit_info.value.code == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")


@bounded(200)
@given(shape=st.tuples(st.integers(1, 3), st.integers(2, 8)), data=st.data())
def test_example_losses_and_embeddings_follow_the_trained_tokens_and_the_mask(shape, data):
    """Per example: the loss is the mean NLL over the trained positions only (NaN when there is none), the count is
    exact, and pooling reads only real (unpadded) positions, for any labels and right padding."""
    rows, width = shape
    seed = data.draw(st.integers(0, 2**31), label="seed")
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, 5, generator=generator) * data.draw(st.sampled_from([0.1, 1.0, 30.0]))
    labels = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, 4), min_size=width, max_size=width),
                                             min_size=rows, max_size=rows)))
    labels[labels < 0] = IGNORE  # -1 drawn: a masked position
    loss, n_tokens = example_losses(logits, labels)
    assert n_tokens.tolist() == (labels[:, 1:] != IGNORE).sum(dim=1).tolist()
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    for i in range(rows):
        trained = [(t, int(labels[i, t + 1])) for t in range(width - 1) if labels[i, t + 1] != IGNORE]
        if not trained:
            assert torch.isnan(loss[i])
        else:
            expected = -sum(float(log_probs[i, t, label]) for t, label in trained) / len(trained)
            assert float(loss[i]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    lengths = data.draw(st.lists(st.integers(1, width), min_size=rows, max_size=rows))
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    hidden = torch.randn(rows, width, 3, generator=generator)
    last, mean = pool_hidden(hidden, mask, "last"), pool_hidden(hidden, mask, "mean")
    for i, n in enumerate(lengths):
        assert torch.equal(last[i], hidden[i, n - 1])
        assert torch.allclose(mean[i], hidden[i, :n].mean(dim=0), atol=1e-6)


# A value where text belongs that is not text: a number or a list (a null is just missing text).
NOT_TEXT = st.integers() | st.lists(st.integers(), max_size=2)


@pytest.mark.slow
@bounded(25)
@given(records=st.lists(st.tuples(TEXT | st.none(), TEXT | st.none(), st.booleans()), min_size=1, max_size=12),
       poison=st.none() | st.tuples(st.integers(0, 11), st.integers(0, 1), NOT_TEXT),
       val_fraction=st.sampled_from([0.0, 0.2, 0.5]), max_length=st.integers(2, 48))
def test_any_records_are_scored_whole_or_refused_in_one_line(tokenizer, work, records, poison, val_fraction,
                                                             max_length):
    """Inference's examples: every record scored at most once, under its own (split, index) (a record's own "index"
    field gives way); a record without text where text belongs is dropped; anything else is one UserError line."""
    if poison is not None:
        row, field, value = poison
        row %= len(records)
        records[row] = tuple(value if i == field else v for i, v in enumerate(records[row]))
    folder = work / "inference-records"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    with open(folder / "r_clean.jsonl", "w", encoding="utf-8") as f:
        for prompt, response, with_index in records:
            f.write(json.dumps({"prompt": prompt, "response": response, **({"index": 99} if with_index else {})})
                    + "\n")
    config = InferenceConfig(model_name="m", dataset_path=str(folder), max_length=max_length,
                             val_fraction=val_fraction, num_proc=1)
    try:
        examples = load_examples(config, tokenizer)
    except UserError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 600
        return
    keys = list(zip(examples.split_codes.tolist(), examples.indices.tolist()))
    assert len(set(keys)) == len(keys) == len(examples.dataset) and all(0 <= i < len(records) for _, i in keys)
    kept = examples.dataset
    assert all(isinstance(p, str) and isinstance(r, str) for p, r in zip(kept["prompt"], kept["response"]))
    assert all(records[i][0] == p for (_, i), p in zip(keys, kept["prompt"]))


# ---------------------------------------------------------------- build_map's input: inference.parquet

EMBEDDING_ROW = st.none() | st.lists(st.floats(width=32) | st.none(), max_size=4)
TEXT_COLUMN = st.lists(TEXT | st.none(), min_size=1, max_size=6) | st.lists(st.integers(-3, 3), min_size=1, max_size=6)


@bounded(150)
@given(embedding=st.lists(EMBEDDING_ROW, min_size=1, max_size=6), prompt=TEXT_COLUMN,
       loss=st.lists(st.floats() | st.none(), min_size=1, max_size=6), with_source=st.booleans())
@example(embedding=[[0.5, 1.0], [1.0], [2.0, 3.0, 4.0]], prompt=["a", "b", "c"], loss=[1.0, 2.0, 3.0],
         with_source=True)  # 6 values for 3 rows: read as a 3 x 2 matrix before, across the rows' boundaries
def test_any_inference_table_is_read_whole_or_refused_in_one_line(work, embedding, prompt, loss, with_source):
    """load_run gives an (n, d) matrix of finite numbers read row by row, and text prompts, or one UserError line
    naming the file; never another exception."""
    n = min(len(embedding), len(prompt), len(loss))
    columns = {"prompt": pa.array(prompt[:n]), "response": [f"r{i}" for i in range(n)], "index": list(range(n)),
               "split": ["train"] * n, "loss": pa.array(loss[:n], pa.float64()), "n_tokens": [3] * n,
               "embedding": pa.array(embedding[:n], pa.list_(pa.float32()))}
    if with_source:
        columns["source"] = ["s"] * n
    folder = work / "map-input"
    folder.mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), folder / "inference.parquet")
    try:
        run = load_run(folder)
    except UserError as exc:
        message = str(exc)
        assert message.startswith(f"{folder / 'inference.parquet'}: ") and "\n" not in message and len(message) < 600
        return
    rows = [list(row) for row in embedding[:n]]
    assert run.embeddings.shape == (n, len(rows[0])) and len(rows[0]) >= 1
    assert np.array_equal(run.embeddings, np.array(rows, dtype=np.float32))
    assert np.isfinite(run.embeddings).all()
    assert run.prompt.to_pylist() == prompt[:n] and all(isinstance(p, str) for p in prompt[:n])
