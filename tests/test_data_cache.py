"""data/cache.py: tokenized fine-tuning data reused by a second start with the same inputs, tokenized again after
any change to what decides the tokens, and rebuilt when an entry is incomplete or corrupt. Driven through the
fine-tuning objective's load_data, the path train(), plan and check take."""

from __future__ import annotations

import json

import pytest
from support.files import write_config, write_jsonl
from support.launch import explain, run_train
from support.models import CHAT_TEMPLATE

import gpt4all_training.data.cache as cache
import gpt4all_training.data.sft as sft
from gpt4all_training.config.loader import load_config
from gpt4all_training.training.objectives.sft import FineTuning

ROWS = [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}.", "source": "t"} for i in range(60)]


@pytest.fixture
def data_dir(tmp_path):
    return write_jsonl(tmp_path / "data" / "sums_clean.jsonl", ROWS).parent


@pytest.fixture
def tokenizations(monkeypatch):
    """How many times the records were tokenized (sft.load_data ran) since the fixture started."""
    calls = []
    load_data = sft.load_data

    def counted(*args, **kwargs):
        calls.append(1)
        return load_data(*args, **kwargs)

    monkeypatch.setattr("gpt4all_training.training.objectives.sft.load_data", counted)
    return calls


def start(tokenizer, tiny_model_dir, data_dir, tmp_path, *overrides):
    """One start's data loading: (data, the cache's log lines)."""
    config = load_config(None, [f"model_name={tiny_model_dir}", f"dataset_path={data_dir}",
                                f"output_dir={tmp_path / 'run'}", "max_length=32", *overrides])
    lines = []
    data = FineTuning(config).load_data(config, tokenizer, lines.append, 1)
    return data, [line for line in lines if line.startswith("tokenized data:")]


def columns(split) -> dict:
    return {name: list(split[name]) for name in ("input_ids", "labels", "index", "n_trained")}


def test_the_tokenizer_fingerprint_ignores_the_padding_and_truncation_a_call_left(tokenizer):
    """A fast tokenizer keeps the padding and truncation of its last call; a fingerprint taken after a padded call
    (a plan, another stage) is the fresh tokenizer's, or the second start of a run would miss its own cache."""
    fresh = cache.tokenizer_fingerprint(tokenizer)
    tokenizer(["a", "a b c"], padding=True, truncation=True, max_length=2)
    assert tokenizer.backend_tokenizer.padding is not None  # the state the call left
    assert cache.tokenizer_fingerprint(tokenizer) == fresh


def test_a_second_start_loads_the_tokenized_splits(tokenizer, tiny_model_dir, data_dir, tmp_path, tokenizations):
    first, first_lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    second, second_lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    assert len(tokenizations) == 1
    assert len(first_lines) == len(second_lines) == 1
    assert "cache miss (nothing cached for this data, tokenizer and settings)" in first_lines[0]
    assert "cache hit" in second_lines[0] and str(tmp_path / "run" / "tokenized") in second_lines[0]
    for got, want in ((second.train, first.train), (second.val, first.val)):
        assert columns(got) == columns(want) and len(got) > 0
    assert (second.train_stats, second.val_stats) == (first.train_stats, first.val_stats)
    assert second.fingerprint == first.fingerprint


@pytest.mark.parametrize("change", ["max_length=24", "prompt_template=chat", "val_fraction=0.2", "seed=3",
                                    "train_turns=last", "data", "tokenizer", "code"])
def test_any_change_to_what_decides_the_tokens_tokenizes_again(change, tokenizer, chat_tokenizer, tiny_model_dir,
                                                               data_dir, tmp_path, tokenizations, monkeypatch):
    """train_turns changes nothing in prompt/response data, but as a masking option it is in the key all the same."""
    start(chat_tokenizer, tiny_model_dir, data_dir, tmp_path, "prompt_template=plain")
    used, overrides = chat_tokenizer, ["prompt_template=plain"]
    if change == "data":
        write_jsonl(data_dir / "sums_clean.jsonl", [*ROWS[:-1], {**ROWS[-1], "response": "Twice that."}])
    elif change == "tokenizer":
        used = tokenizer  # the chat tokenizer less its two special tokens and its chat template
    elif change == "code":
        monkeypatch.setattr(cache, "code_version", lambda: "a changed data package")
    else:
        overrides.append(change)
    _, lines = start(used, tiny_model_dir, data_dir, tmp_path, *overrides)
    assert "cache miss" in lines[0] and len(tokenizations) == 2


def test_the_chat_template_is_part_of_the_key(chat_tokenizer, tiny_model_dir, data_dir, tmp_path, tokenizations):
    start(chat_tokenizer, tiny_model_dir, data_dir, tmp_path, "prompt_template=chat")
    chat_tokenizer.chat_template = CHAT_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>\n\n")
    try:
        _, lines = start(chat_tokenizer, tiny_model_dir, data_dir, tmp_path, "prompt_template=chat")
    finally:
        chat_tokenizer.chat_template = CHAT_TEMPLATE
    assert "cache miss" in lines[0] and len(tokenizations) == 2


def test_settings_that_do_not_decide_the_tokens_still_hit(tokenizer, tiny_model_dir, data_dir, tmp_path,
                                                          tokenizations):
    """num_proc, the learning rate, the batch: the same tokens. So does the data moved to another folder."""
    start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    moved = data_dir.rename(tmp_path / "moved")
    _, lines = start(tokenizer, tiny_model_dir, moved, tmp_path, "num_proc=1", "lr=1e-3", "batch_size=2")
    assert "cache hit" in lines[0] and len(tokenizations) == 1


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete the marker", "delete stats"])
def test_a_corrupt_or_incomplete_entry_is_detected_and_rebuilt(damage, tokenizer, tiny_model_dir, data_dir, tmp_path,
                                                               tokenizations):
    first, _ = start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    expected = columns(first.train)  # read now: the splits map the entry's files, which the damage rewrites
    (entry,) = [p for p in (tmp_path / "run" / "tokenized").iterdir() if p.is_dir()]  # beside it: its lock
    arrow = sorted((entry / "train").glob("*.arrow"))[0]
    if damage == "flip a byte":
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 0xFF
        arrow.write_bytes(bytes(data))
    elif damage == "truncate":
        arrow.write_bytes(arrow.read_bytes()[:100])
    elif damage == "delete the marker":
        (entry / "COMPLETE").unlink()
    else:
        (entry / "stats.json").unlink()
    rebuilt, lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    assert "cache miss (the entry was " in lines[0] and "rebuilt" in lines[0]
    assert columns(rebuilt.train) == expected
    _, lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path)
    assert "cache hit" in lines[0] and len(tokenizations) == 2


def test_cache_dir_is_shared_by_runs_and_an_unwritable_one_costs_only_the_cache(tokenizer, tiny_model_dir, data_dir,
                                                                               tmp_path, tokenizations):
    shared = tmp_path / "shared"
    start(tokenizer, tiny_model_dir, data_dir, tmp_path / "a", f"cache_dir={shared}")
    _, lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path / "b", f"cache_dir={shared}")
    assert "cache hit" in lines[0] and str(shared) in lines[0] and not (tmp_path / "b" / "run").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    data, lines = start(tokenizer, tiny_model_dir, data_dir, tmp_path, f"cache_dir={blocked}")
    assert "cache miss" in lines[0] and "not saved" in lines[0] and len(data.train) > 0


@pytest.mark.integration
@pytest.mark.slow
def test_train_restarted_in_its_output_dir_uses_the_cache_and_trains_the_same(tiny_model_dir, data_dir, tmp_path):
    config = write_config(tmp_path, {"model_name": str(tiny_model_dir), "dataset_path": str(data_dir),
                                     "max_length": 32, "batch_size": 4, "max_steps": 3, "eval_every": None,
                                     "save_every": None, "num_proc": 1})
    runs = []
    for overrides in ((), ("resume=never",)):  # a finished run is trained again only when set aside: not its cache
        result = run_train(config, tmp_path / "run", *overrides)
        assert result.returncode == 0, explain(result)
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        runs.append((result.stdout, [(r["step"], r["loss"]) for r in rows if "loss" in r]))
    assert "tokenized data: cache miss" in runs[0][0] and "tokenized data: cache hit" in runs[1][0]
    assert runs[0][1][-3:] == runs[1][1][-3:]
