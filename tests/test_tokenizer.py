"""Tokenizer training: exact round trips, indentation tokens for code, statistics, the command and its errors."""

from __future__ import annotations

import argparse
import json
import keyword
import subprocess
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.files import dolly_texts, write_jsonl
from support.paths import PYTHON, REPO
from gpt4all_training.errors import UserError
from gpt4all_training.cli.tokenizer import run
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.fields import choices
from gpt4all_training.config.schemas import EOS, TokenizerConfig
from gpt4all_training.data.bpe import CODE_KEYWORDS, build_tokenizer, tokenizer_stats, train_bpe_tokenizer

# Python source to learn from: the standard library's own modules, read by path (nothing is copied into the repo).
STDLIB = Path(keyword.__file__).parent
CODE_SNIPPET = "def f(x):\n    if x:\n        return x\n    return None\n"


def python_sources(count: int) -> list[str]:
    files = sorted(STDLIB.glob("*.py"))[:count]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def pieces(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory) -> Path:
    """80 stdlib modules as a JSONL corpus with a `content` field (CodeParrot's name for it)."""
    path = tmp_path_factory.mktemp("code") / "code.jsonl"
    return write_jsonl(path, [{"content": text, "path": "x.py"} for text in python_sources(80)])


@pytest.fixture(scope="module")
def code_tokenizer_dir(code_corpus, tmp_path_factory) -> Path:
    """Trained through the command, exactly as a user would: config file, save_pretrained, statistics."""
    folder = tmp_path_factory.mktemp("code-tok")
    config = folder / "tok.yaml"
    config.write_text(f"dataset_path: {code_corpus}\nvocab_size: 2000\ncode_language: python\nheldout_size: 8\n"
                      f"output_dir: {folder / 'out'}\n")
    assert run(argparse.Namespace(config=str(config), overrides=[])) == 0
    return folder / "out"


@pytest.fixture(scope="module")
def roundtrip_tokenizer(tmp_path_factory):
    """A small tokenizer trained on prose, saved and reloaded through AutoTokenizer (what training loads)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("rt")
    train_bpe_tokenizer(dolly_texts(600), vocab_size=600, split_indentation=True).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200))
@example(text="\n    \tmixed  \r\n\u00a0indent\u3000 \U0001F600 e\u0301 \x00 " + EOS + " after")
@example(text="  leading spaces, trailing spaces   ")
@example(text="\n\n\n        \n")
def test_roundtrip_is_exact_for_any_unicode(roundtrip_tokenizer, text):
    ids = roundtrip_tokenizer.encode(text, add_special_tokens=False)
    assert roundtrip_tokenizer.decode(ids) == text
    assert roundtrip_tokenizer.unk_token_id not in ids or EOS in text  # byte alphabet: nothing is unknown


@settings(max_examples=100, derandomize=True, deadline=None)
@given(text=st.text(max_size=200))
@example(text="\n    \tcode\r\n" + EOS + "\u00e9\U0001F600")
def test_gpt2_style_fixture_tokenizer_roundtrips_too(tokenizer, text):
    """The session fixture's tokenizer (no indentation split, as every other test's tiny model uses)."""
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_python_tokenizer_keeps_four_space_indentation_as_one_token(code_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(code_tokenizer_dir)
    assert pieces(tokenizer, CODE_SNIPPET) == ["def", " f", "(", "x", "):", "\n", "    ", "if", " x", ":", "\n",
                                               "        ", "return", " x", "\n", "    ", "return", " None", "\n"]
    stats = json.loads((code_tokenizer_dir / "tokenizer_stats.json").read_text())
    assert stats["indentation"]["4 spaces"] and stats["indentation"]["8 spaces"]
    assert all(stats["keywords_line_start"][k] for k in ("def", "class", "if", "return", "import", "for", "else"))


def test_gpt2_pretokenizer_cannot_make_indentation_one_token():
    """Why split_indentation exists: GPT-2's split glues the newline to 3 spaces and the 4th to the next word."""
    tokenizer = train_bpe_tokenizer(python_sources(40), vocab_size=1500, split_indentation=False)
    got = pieces(tokenizer, CODE_SNIPPET)
    assert got[5:7] == ["\n   ", " if"]
    assert "    " not in got


def test_saved_tokenizer_loads_with_autotokenizer_and_encodes_identically(code_tokenizer_dir, code_corpus):
    from transformers import AutoTokenizer
    from tokenizers import Tokenizer

    loaded = AutoTokenizer.from_pretrained(code_tokenizer_dir)
    raw = Tokenizer.from_file(str(code_tokenizer_dir / "tokenizer.json"))
    text = python_sources(81)[-1]  # a module outside the training corpus
    assert loaded.encode(text, add_special_tokens=False) == raw.encode(text).ids
    assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.eos_token, loaded.eos_token_id, len(loaded)) == (EOS, 0, 2000)


def test_statistics_by_hand():
    """No merges: every byte is a token. One merge learned from 'ab': 'ab' is one token."""
    no_merges = train_bpe_tokenizer(["ab"] * 10, vocab_size=257)
    stats = tokenizer_stats(no_merges, ["ab cd!"])
    # words: 'ab', ' cd' ('!' has no letter); tokens: a b ' ' c d ! = 6
    assert (stats.words, stats.tokens, stats.fertility, stats.split_share) == (2, 6, 3.0, 1.0)
    one_merge = train_bpe_tokenizer(["ab"] * 10, vocab_size=258)
    stats = tokenizer_stats(one_merge, ["ab cd!"])
    # tokens: ab ' ' c d ! = 5; 'ab' is whole, ' cd' is split
    assert (stats.words, stats.tokens, stats.fertility, stats.split_share) == (2, 5, 2.5, 0.5)


def test_held_out_records_are_not_trained_on(tmp_path):
    """Record 0 (held out, every 10th) holds a word repeated often enough to merge if it were trained on."""
    rows = [{"text": "zqzqzq " * 50}] + [{"text": "plain words here"} for _ in range(9)]
    config = validate(TokenizerConfig(dataset_path=str(write_jsonl(tmp_path / "d.jsonl", rows)),
                                      vocab_size=300, heldout_size=1, min_frequency=1))
    tokenizer, stats = build_tokenizer(config)
    assert "zq" not in tokenizer.get_vocab() and "Ġhere" in tokenizer.get_vocab()
    assert stats.texts == 1 and stats.split_share == 1.0  # ' zqzqzq' is never one token


@pytest.mark.parametrize("rows, overrides, message", [
    ([{"text": "a"}, {"body": "b"}], {}, r"d\.jsonl:2: no a 'text' or 'content' field \(fields: body\); set text_field"),
    ([{"text": "a"}, {"text": 3}], {}, r"d\.jsonl:2: field 'text' is int, not text"),
    ([{"text": "a"}], {"text_field": "body"}, r"d\.jsonl:1: no field 'body'"),
    ([{"text": "a"}], {"vocab_size": 200}, r"vocab_size: must be at least 256 \+ 1 .*got 200"),
    ([{"text": "a"}], {"code_language": "cobol"}, r"code_language: must be one of python, got 'cobol'"),
])
def test_config_and_data_errors_say_what_to_fix(tmp_path, rows, overrides, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=message):
        config = validate(TokenizerConfig(dataset_path=str(path), **{"vocab_size": 300, **overrides}))
        build_tokenizer(config)


def test_bad_json_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl:3: not valid JSON"):
        build_tokenizer(TokenizerConfig(dataset_path=str(path), vocab_size=300))


@pytest.mark.integration
def test_command_line_prints_statistics(code_corpus, tmp_path):
    out = tmp_path / "tok"
    result = subprocess.run([PYTHON, "-m", "gpt4all_training.cli", "tokenizer", f"dataset_path={code_corpus}",
                             "vocab_size=800", "code_language=python", "max_examples=20", "heldout_size=2",
                             f"output_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"tokenizer: 800 tokens, saved to {out}" in result.stdout
    assert "fertility: " in result.stdout and "indentation runs that are one token: 2 spaces" in result.stdout
    bad = subprocess.run([PYTHON, "-m", "gpt4all_training.cli", "tokenizer",
                          f"dataset_path={tmp_path / 'none.jsonl'}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: dataset_path: {tmp_path / 'none.jsonl'} does not exist"


def test_every_code_language_choice_has_its_keywords():
    assert choices(typing.get_type_hints(TokenizerConfig)["code_language"]) == tuple(CODE_KEYWORDS)
