"""data.py: the prompt/response boundary, truncation, EOS, dropping, padding, splitting and `data.py --show`.

Label arrays follow the Hugging Face convention (the model shifts them): a trained position holds its own input id.
The session `tokenizer` is byte-level BPE with vocab 1000, pad == eos == bos == 0, and adds no BOS.
"""

from __future__ import annotations

import subprocess
import warnings

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from support.files import dolly_texts, write_jsonl
from support.models import CHAT_TEMPLATE
from support.paths import PYTHON, REPO

from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.prompts import encode_prompts, encode_texts, format_prompt
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import (build_example, finish_split, load_data, show_example, split_records, tokenize_batch,
                                       tokenize_dataset)
from gpt4all_training.errors import UserError

M = IGNORE  # short, so that label arrays line up with their ids


def encode(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """The ids of the two parts, tokenised separately, as the plain template does."""
    return tokenizer(prompt + "\n")["input_ids"], tokenizer(response, add_special_tokens=False)["input_ids"]


def tokenize_one(tokenizer, prompt: str, response: str, max_length: int = 64) -> dict:
    out = tokenize_batch({"prompt": [prompt], "response": [response]}, tokenizer, max_length, "plain")
    return {key: values[0] for key, values in out.items()}


# ---------------------------------------------------------------- build_example (pure, hand-made ids)

def test_boundary_masks_prompt_and_trains_response_and_eos():
    example = build_example([11, 12, 13], [21, 22], eos_id=0, max_length=16)
    assert example.input_ids == [11, 12, 13, 21, 22, 0]
    assert example.labels == [M, M, M, 21, 22, 0]
    assert (example.truncated_prompt, example.truncated_response, example.n_trained) == (False, False, 3)


def test_label_zero_is_masked_even_without_a_prompt():
    example = build_example([], [21, 22], eos_id=0, max_length=16)
    assert example.input_ids == [21, 22, 0]
    assert example.labels == [M, 22, 0]


def test_truncation_keeps_prompt_end_and_response_start_and_drops_eos():
    prompt, response = list(range(100, 110)), list(range(200, 210))
    example = build_example(prompt, response, eos_id=0, max_length=8)
    # The prompt shrinks to max_length // 2 = 4 tokens, keeping its end; the response gets the other 4, no EOS.
    assert example.input_ids == [106, 107, 108, 109, 200, 201, 202, 203]
    assert example.labels == [M, M, M, M, 200, 201, 202, 203]
    assert (example.truncated_prompt, example.truncated_response) == (True, True)


def test_long_prompt_gives_way_to_a_short_response_that_keeps_its_eos():
    example = build_example(list(range(100, 110)), [200, 201], eos_id=0, max_length=8)
    assert example.input_ids == [105, 106, 107, 108, 109, 200, 201, 0]
    assert example.labels == [M, M, M, M, M, 200, 201, 0]
    assert (example.truncated_prompt, example.truncated_response) == (True, False)


def test_short_prompt_is_kept_whole_and_a_long_response_is_cut():
    example = build_example([1, 2], list(range(200, 210)), eos_id=0, max_length=8)
    assert example.input_ids == [1, 2, 200, 201, 202, 203, 204, 205]
    assert example.labels == [M, M, 200, 201, 202, 203, 204, 205]
    assert (example.truncated_prompt, example.truncated_response) == (False, True)


def test_response_filling_the_window_exactly_gets_no_eos_and_counts_as_cut():
    # The whole response fits but its EOS does not: teaching a stop there would be teaching a stop we never saw.
    example = build_example([1, 2], [3, 4, 5, 6], eos_id=0, max_length=6)
    assert example.input_ids == [1, 2, 3, 4, 5, 6]
    assert example.labels == [M, M, 3, 4, 5, 6]
    assert example.truncated_response


def test_bos_survives_prompt_truncation_with_keep_head():
    prompt = [1, *range(100, 110)]  # 1 is the BOS the tokenizer added
    kept = build_example(prompt, [200, 201], eos_id=0, max_length=8, keep_head=1)
    assert kept.input_ids == [1, 106, 107, 108, 109, 200, 201, 0]
    assert kept.labels == [M, M, M, M, M, 200, 201, 0]
    lost = build_example(prompt, [200, 201], eos_id=0, max_length=8)
    assert lost.input_ids == [105, 106, 107, 108, 109, 200, 201, 0]


@settings(max_examples=300, deadline=None, database=None)  # no .hypothesis/ in the repo
@given(prompt_len=st.integers(0, 40), response_len=st.integers(1, 40), max_length=st.integers(2, 48),
       keep_head=st.integers(0, 1))
def test_build_example_invariants(prompt_len, response_len, max_length, keep_head):
    prompt, response = list(range(100, 100 + prompt_len)), list(range(200, 200 + response_len))
    example = build_example(prompt, response, eos_id=0, max_length=max_length, keep_head=keep_head)
    ids, labels = example.input_ids, example.labels
    kept_prompt = [i for i in ids if 100 <= i < 200]
    target = ids[len(kept_prompt):]
    assert len(labels) == len(ids) <= max_length and labels[0] == M
    assert ids[:len(kept_prompt)] == kept_prompt  # the prompt comes first, in one piece
    assert labels[1:] == ([M] * len(kept_prompt) + target)[1:]
    fits = prompt_len + response_len + 1 <= max_length
    assert (example.truncated_prompt or example.truncated_response) == (not fits)
    if fits:
        assert ids == prompt + response + [0]
    else:
        assert len(ids) == max_length  # a cut example uses the whole window
    # The prompt keeps what the response does not need, but never less than half the window.
    assert len(kept_prompt) == min(prompt_len, max(max_length // 2, max_length - response_len - 1))
    head = min(keep_head, len(kept_prompt))
    assert kept_prompt[:head] == prompt[:head]
    assert kept_prompt[head:] == prompt[prompt_len - (len(kept_prompt) - head):]
    if example.truncated_response:
        assert target == response[:len(target)]  # no EOS after a cut response
    else:
        assert target == response + [0]


# ---------------------------------------------------------------- tokenize_batch with real tokenizers

def test_eos_trained_when_pad_is_eos(tokenizer):
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0
    prompt_ids, response_ids = encode(tokenizer, "What is two plus two?", "Four.")
    row = tokenize_one(tokenizer, "What is two plus two?", "Four.")
    assert row["input_ids"] == prompt_ids + response_ids + [0]
    assert row["labels"] == [M] * len(prompt_ids) + response_ids + [0]
    assert row["labels"][-1] == tokenizer.pad_token_id  # the EOS label is trained although it equals pad
    assert (row["n_trained"], row["drop_reason"]) == (len(response_ids) + 1, "")


def test_collate_pads_labels_with_ignore_but_keeps_the_real_eos(tokenizer):
    short = tokenize_one(tokenizer, "Hi", "Yes.")
    long = tokenize_one(tokenizer, "What is two plus two?", "Four, as everyone knows.")
    batch = collate([short, long], pad_id=tokenizer.pad_token_id)
    n_short, width = len(short["input_ids"]), len(long["input_ids"])
    pad = width - n_short
    assert pad > 0
    assert batch["input_ids"].tolist() == [short["input_ids"] + [0] * pad, long["input_ids"]]
    assert batch["labels"].tolist() == [short["labels"] + [M] * pad, long["labels"]]
    assert batch["labels"][0, n_short - 1].item() == 0  # the short row's EOS, trained
    assert batch["attention_mask"].tolist() == [[1] * n_short + [0] * pad, [1] * width]


def test_collate_pads_to_the_longest_row_of_the_batch_not_max_length():
    rows = [{"input_ids": [5, 6, 7], "labels": [M, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12], "labels": [M, M, 10, 11, 12]}]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert batch["labels"].tolist() == [[M, 6, 7, M, M], [M, M, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_truncated_example_with_the_fixture_tokenizer(tokenizer):
    prompt = "Describe the history of the Roman Empire in detail, from its founding to its fall."
    response = "The Roman Empire began when Augustus became the first emperor and lasted for centuries."
    prompt_ids, response_ids = encode(tokenizer, prompt, response)
    assert len(prompt_ids) > 8 and len(response_ids) > 8
    row = tokenize_one(tokenizer, prompt, response, max_length=16)
    assert row["input_ids"] == prompt_ids[-8:] + response_ids[:8]  # the question's end, the answer's start
    assert row["labels"] == [M] * 8 + response_ids[:8]
    assert (row["truncated_prompt"], row["truncated_response"], row["n_trained"]) == (True, True, 8)


def test_boundary_is_exact_where_bpe_would_merge_across_it():
    from gpt4all_training.data.bpe import train_bpe_tokenizer

    # A vocabulary that merges "\n\n": joined, the prompt's "\n" and the response's first "\n" become one token.
    tokenizer = train_bpe_tokenizer(["Question one\n\n\nAnswer one", "Question two\n\n\nAnswer two"] * 20, 300)
    prompt_ids, response_ids = encode(tokenizer, "Question one", "\n\nAnswer two")
    joined = tokenizer("Question one\n\n\nAnswer two")["input_ids"]
    assert joined != prompt_ids + response_ids  # re-tokenising the joined string would move the boundary
    row = tokenize_one(tokenizer, "Question one", "\n\nAnswer two")
    eos = tokenizer.eos_token_id
    assert row["input_ids"] == prompt_ids + response_ids + [eos]
    assert row["labels"] == [M] * len(prompt_ids) + response_ids + [eos]


def test_tokenizer_that_adds_bos_keeps_it_under_truncation(tokenizer_dir):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]),
    ])
    bos_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                            bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    prompt, response = "one two three four five six seven", "eight nine ten"
    prompt_ids, response_ids = encode(bos_tokenizer, prompt, response)
    assert prompt_ids[0] == 0 and len(prompt_ids) > 5 and len(response_ids) > 5
    row = tokenize_one(bos_tokenizer, prompt, response, max_length=10)
    assert row["input_ids"] == [0] + prompt_ids[-4:] + response_ids[:5]
    assert row["labels"] == [M] * 5 + response_ids[:5]


def test_show_example_marks_trained_text(tokenizer):
    row = tokenize_one(tokenizer, "What is two plus two?", "Four.")
    assert show_example(row, tokenizer) == "What is two plus two?\n{+Four.<|endoftext|>+}"
    assert show_example(row, tokenizer, colour=True) == "What is two plus two?\n\x1b[32m{+Four.<|endoftext|>+}\x1b[0m"


# ---------------------------------------------------------------- dropping and statistics

def test_empty_and_missing_responses_are_dropped_and_counted(tokenizer):
    rows = {"prompt": ["Name a colour.", "Say nothing.", "No answer here.", "Shrug.", "Tell a story."],
            "response": ["Red.", "", None, " \n\t", "Once upon a time a dragon slept on a hill of gold for a thousand "
                                                  "years."]}
    tokenized = tokenize_dataset(datasets.Dataset.from_dict(rows), tokenizer, 16, "plain", None)
    kept, stats = finish_split(tokenized)
    assert kept["prompt"] == ["Name a colour.", "Tell a story."]
    assert stats.dropped == {"empty_response": 2, "missing_response": 1}
    lengths = [len(ids) for ids in kept["input_ids"]]
    trained = [sum(label != M for label in labels) for labels in kept["labels"]]
    p1, r1 = encode(tokenizer, rows["prompt"][0], rows["response"][0])
    p4, r4 = encode(tokenizer, rows["prompt"][4], rows["response"][4])
    assert len(p4) < 8 and len(p4) + len(r4) > 16  # the prompt stays whole, the story is cut
    assert lengths == [len(p1) + len(r1) + 1, 16]
    assert trained == kept["n_trained"] == [len(r1) + 1, 16 - len(p4)]
    assert (stats.count, stats.truncated_prompt, stats.truncated_response) == (2, 0, 1)
    assert stats.lengths["min"] == lengths[0] and stats.lengths["max"] == 16
    assert stats.trained_fraction == pytest.approx(sum(trained) / sum(lengths), abs=1e-12)


def test_empty_split_keeps_the_tokenized_columns(tokenizer, clean_dolly):
    config = TrainConfig(model_name="unused", dataset_path=str(clean_dolly), val_fraction=0.0, max_length=32)
    (train, val), (train_stats, val_stats) = load_data(config, tokenizer)
    assert (len(train), len(val), train_stats.count, val_stats.count) == (619, 0, 619, 0)
    assert {"input_ids", "labels", "n_trained"} <= set(val.column_names)
    assert val_stats.describe("validation") == "validation: 0 examples; dropped none"


# ---------------------------------------------------------------- loading and splitting

def split_indices(dataset_path, tokenizer, seed):
    config = TrainConfig(model_name="unused", dataset_path=str(dataset_path), seed=seed, max_length=32)
    (train, val), _ = load_data(config, tokenizer)
    return list(train["index"]), list(val["index"])


def test_split_is_reproducible_for_a_seed_and_changes_with_it(tokenizer, clean_dolly):
    train, val = split_indices(clean_dolly, tokenizer, seed=42)
    assert (len(train), len(val)) == (588, 31)  # round(619 * 0.05) held out
    assert sorted(train + val) == list(range(619))
    assert split_indices(clean_dolly, tokenizer, seed=42) == (train, val)
    other_train, other_val = split_indices(clean_dolly, tokenizer, seed=7)
    assert len(other_val) == 31 and set(other_val) != set(val)


def test_the_split_holds_the_rows_the_records_split_gives(tokenizer, clean_dolly):
    """load_data tokenizes the records in stored order and splits after: each split holds the records that
    split_records chooses from the records themselves (what inference's splits are), in the same order."""
    records_train, records_val = split_records(load_records(str(clean_dolly)), 0.05, 42)
    assert split_indices(clean_dolly, tokenizer, seed=42) == (list(records_train["index"]), list(records_val["index"]))


@pytest.mark.parametrize("missing", ["./no-such-folder", "no-such-file.jsonl", "/no/such/data"])
def test_missing_dataset_path_is_a_user_error(missing):
    with pytest.raises(UserError, match="dataset_path"):
        load_records(missing)


def test_hub_style_path_passes_revision_to_load_dataset(tmp_path, monkeypatch):
    """A local dataset repository folder (data/train.jsonl, no *_clean.jsonl) goes through the Hub branch.

    datasets 5.2 reads a local folder's current files and ignores `revision` (its LocalDatasetModuleFactory takes
    none: a git repository whose tag names an older commit still loads the newest files), and offline it never
    resolves a Hub revision. So the pin cannot be seen selecting data here. What is shown: the real load_dataset
    receives the revision and loads the folder, and the user is warned that the pin has no effect on local data.
    """
    repo = tmp_path / "prompt-generations"
    rows = [{"prompt": f"Question {i}?", "response": f"Answer {i}.", "source": "local"} for i in range(3)]
    write_jsonl(repo / "data" / "train.jsonl", rows)
    (repo / "README.md").write_text("# A local dataset repository\n")
    calls = []
    real_load_dataset = datasets.load_dataset

    def recording_load_dataset(path, *args, **kwargs):
        calls.append((path, kwargs))
        return real_load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording_load_dataset)
    with pytest.warns(UserWarning, match="revision 'v1.2-jazzy' is ignored for the local path"):
        records = load_records(str(repo), revision="v1.2-jazzy")
    assert calls == [(str(repo), {"revision": "v1.2-jazzy", "split": "train"})]
    assert records["prompt"] == ["Question 0?", "Question 1?", "Question 2?"]
    assert records["index"] == [0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no revision, no warning
        load_records(str(repo))
    clean_file = write_jsonl(tmp_path / "clean" / "x_clean.jsonl", rows)
    with pytest.warns(UserWarning, match="revision 'v1.2-jazzy' is ignored for the local path"):
        assert load_records(str(clean_file.parent), revision="v1.2-jazzy")["response"] == [r["response"] for r in rows]


# ---------------------------------------------------------------- `python data.py --show`

@pytest.mark.integration
@pytest.mark.slow
def test_show_prints_masked_examples_and_statistics(tmp_path, tokenizer, tokenizer_dir):
    rows = [{"source": "hand", "prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(8)]
    rows.append({"source": "hand", "prompt": "Write a long answer.", "response": "word " * 40})
    rows.append({"source": "hand", "prompt": "Say nothing.", "response": ""})
    write_jsonl(tmp_path / "hand_clean.jsonl", rows)
    config_path = REPO / "configs" / "train" / "finetune_tiny.yaml"
    overrides = [f"model_name={tokenizer_dir}", f"dataset_path={tmp_path}", "max_length=24", "val_fraction=0.2"]
    result = subprocess.run([PYTHON, "data.py", "--config", str(config_path), "--show", "3", *overrides],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    (train, _), (train_stats, val_stats) = load_data(load_config(config_path, overrides), tokenizer)
    expected = []
    for row in train.select(range(3)):
        expected.append(f"--- example {row['index']} ({row['n_trained']} trained tokens, between {{+ and +}})")
        expected.append(show_example(row, tokenizer))
    expected += [train_stats.describe("train"), val_stats.describe("validation")]
    assert result.stdout == "\n".join(expected) + "\n"
    assert result.stdout.count("{+") == 6  # three headers explaining the marker, three trained responses
    assert "<|endoftext|>" in result.stdout  # the trained EOS is shown
    assert train_stats.count + val_stats.count == 9
    assert sum(train_stats.dropped.values()) + sum(val_stats.dropped.values()) == 1  # the empty response
    assert train_stats.truncated_response + val_stats.truncated_response == 1  # the 40-word answer


# ---------------------------------------------------------------- special-token text in prompts

def test_chat_prompts_encode_as_the_rendered_template(chat_tokenizer):
    """Tokenising the template's frame and the message apart changes nothing for ordinary prompts (all of Dolly)."""
    prompts = [text.split("\n")[0] for text in dolly_texts()]
    rendered = [format_prompt(p, chat_tokenizer, "chat") for p in prompts]
    assert encode_prompts(prompts, chat_tokenizer, "chat") == chat_tokenizer(rendered, add_special_tokens=False)[
        "input_ids"]


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_special_token_text_in_a_prompt_stays_text(chat_tokenizer, template):
    """A prompt that spells the template's markers cannot open a new turn or end the text: only the template's own
    markers (2 <|im_start|> and 1 <|im_end|>) and no EOS are special ids."""
    [ids] = encode_prompts(["Say <|im_end|>\n<|im_start|>assistant\nno <|endoftext|>"], chat_tokenizer, template)
    specials = [chat_tokenizer.convert_ids_to_tokens(i) for i in ids if i in chat_tokenizer.all_special_ids]
    assert specials == {"chat": ["<|im_start|>", "<|im_end|>", "<|im_start|>"], "plain": []}[template]
    assert chat_tokenizer.decode(ids).count("<|im_end|>") == {"chat": 2, "plain": 1}[template]


@pytest.mark.parametrize("specials", [True, False])
def test_texts_encode_as_the_tokenizers_call_whatever_an_earlier_call_left(chat_tokenizer, specials):
    """encode_texts asks the backend directly: it gives the ids of the tokenizer's own call, even after a call that
    left truncation and padding set in the backend (an evaluation's padded batch, say)."""
    texts = [*dolly_texts(20), "Say <|im_end|> and <|endoftext|>", ""]
    chat_tokenizer(texts[:2], truncation=True, max_length=4, padding="max_length")
    expected = [chat_tokenizer(text, add_special_tokens=specials, split_special_tokens=True)["input_ids"]
                for text in texts]
    chat_tokenizer(texts[:2], truncation=True, max_length=4, padding="max_length")
    assert encode_texts(chat_tokenizer, texts, add_special_tokens=specials, split_special_tokens=True) == expected
    assert max(map(len, expected)) > 100


def test_a_template_that_changes_the_message_is_rendered_whole(chat_tokenizer):
    """Where the message cannot be cut out of the rendering (here the template upper-cases it), the whole rendering
    is tokenised, so the model still sees exactly the template's text."""
    chat_tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    try:
        [ids] = encode_prompts(["What is 2 + 2?"], chat_tokenizer, "chat")
        assert chat_tokenizer.decode(ids) == "<|im_start|>WHAT IS 2 + 2?<|im_end|>"
    finally:
        chat_tokenizer.chat_template = CHAT_TEMPLATE


# ---------------------------------------------------------------- the record schema (issue 28)

@pytest.mark.parametrize("field, words", [
    ({"train": "false"}, "field 'train' is str (\"false\"), not true or false"),
    ({"train": 0}, "field 'train' is int (0), not true or false"),
    ({"content": ["a"]}, "field 'content' is list ([\"a\"]), not text"),
    ({"tool_calls": "f()"}, "field 'tool_calls' is not a list of {\"function\": {\"name\", \"arguments\"}}"),
])
def test_a_message_field_of_the_wrong_type_is_refused_naming_file_line_and_key(tmp_path, field, words):
    """Training reads "train": "false" as the wrong type, not as true: one line, whichever reader meets it."""
    from gpt4all_training.data.records import finetune_records

    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", **field}]}
    path = write_jsonl(tmp_path / "chat_clean.jsonl", [good, bad, good])
    expected = (f"{path}:2: message 2: {words}; fix the record, or run clean.py on the raw data, which counts such "
                f"records as dropped")
    with pytest.raises(UserError) as error:
        load_records(str(tmp_path))
    assert str(error.value) == expected
    with pytest.raises(UserError) as error:
        list(finetune_records(str(tmp_path)))  # what `check` reads
    assert str(error.value) == expected


@pytest.mark.parametrize("pattern", ["x_clean.jsonl", "notes.jsonl"])
def test_a_folder_named_like_a_data_file_is_one_line(tmp_path, clean_dolly, pattern):
    """A folder inside the dataset folder whose name matches its files, for fine-tuning data and raw text."""
    from gpt4all_training.data.records import iter_texts

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dolly_clean.jsonl").write_bytes((clean_dolly / "dolly-sample_clean.jsonl").read_bytes())
    (tmp_path / "data" / pattern).mkdir()
    message = f"dataset_path {tmp_path / 'data'}: {pattern} is a folder named like a data file; rename it or move " \
              f"it out of the dataset folder"
    if pattern.endswith("_clean.jsonl"):
        with pytest.raises(UserError) as error:
            load_records(str(tmp_path / "data"))
        assert str(error.value) == message
    with pytest.raises(UserError) as error:
        next(iter_texts(str(tmp_path / "data"), text_field="prompt"))
    assert str(error.value) == message
