"""Loading prompt/response data and tokenising it with prompt-masked labels (loss only on the response and its EOS).

The boundary is exact at the token level: the prompt and the response are tokenised separately and their ids
concatenated. Labels follow the Hugging Face convention (the model shifts them): a trained position holds its own
input id, every other position holds -100. Label 0 is always -100, since nothing predicts the first token.

A row with `messages` is a conversation: it is rendered with the chat template and labelled by data/chat.py, into
the same columns. A record's own shape decides its path, never the other records': a prompt/response row of a
dataset that also holds conversations (a folder of both kinds of clean files) is tokenised exactly as in a dataset of
prompt/response rows alone.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gpt4all_training.batch import IGNORE
from gpt4all_training.data.chat import UNRENDERED, require_trainable_chat, tokenized_conversations, unrendered_refusal
from gpt4all_training.data.conversations import is_text
from gpt4all_training.data.prompts import encode_prompts, encode_texts, resolve_template
from gpt4all_training.data.records import load_records, record_location, record_sources
from gpt4all_training.data.settings import DataSettings
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_file

# Rows per call of the map function: each call's fixed costs (its tokenizer calls, Arrow conversion) spread over
# many rows, while a batch's Python objects stay a few megabytes.
MAP_BATCH = 1000

# ---------------------------------------------------------------- labels (pure)

@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated_prompt: bool
    truncated_response: bool

    @property
    def n_trained(self) -> int:
        return len(self.labels) - self.labels.count(IGNORE)


def build_example(prompt_ids: list[int], response_ids: list[int], eos_id: int, max_length: int,
                  keep_head: int = 0, room_for: int | None = None) -> Example:
    """Concatenate prompt, response and EOS into at most `max_length` tokens with prompt-masked labels.

    If it does not fit, the prompt keeps its first `keep_head` tokens (a BOS) and its end (the question is
    usually last), shrinking to no less than max_length // 2 while the response needs room; the response then
    keeps as much as fits. A cut response gets no EOS: the model must not learn to stop mid-answer.
    `room_for` is the response length the prompt makes room for (this response's when None): the two answers of a
    preference pair pass the longer one, so that both keep the same prompt.
    """
    prompt, response = list(prompt_ids), list(response_ids)
    room_for = len(response) if room_for is None else room_for
    truncated_prompt = truncated_response = False
    if len(prompt) + room_for + 1 > max_length:
        prompt_budget = min(len(prompt), max(max_length // 2, max_length - room_for - 1))
        if len(prompt) > prompt_budget:
            head = prompt[:min(keep_head, prompt_budget)]
            tail_len = prompt_budget - len(head)
            prompt = head + (prompt[len(prompt) - tail_len:] if tail_len > 0 else [])
            truncated_prompt = True
    room = max_length - len(prompt)
    if len(response) + 1 <= room:
        target = response + [eos_id]
    else:
        target = response[:room]
        truncated_response = True
    input_ids = prompt + target
    labels = [IGNORE] * len(prompt) + target
    labels[0] = IGNORE
    return Example(input_ids, labels, truncated_prompt, truncated_response)


def keep_head_for(tokenizer, template: str) -> int:
    """1 when plain-text encoding starts with a BOS the tokenizer added (truncation must keep it), else 0."""
    if template != "plain" or tokenizer.bos_token_id is None:
        return 0
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return 1 if ids and ids[0] == tokenizer.bos_token_id else 0


def tokenized_features(features):
    """`features` plus the columns tokenize_batch adds. Declared, so that an empty split has them too."""
    from datasets import Features, List, Value

    return Features({**features, "input_ids": List(Value("int32")), "labels": List(Value("int64")),
                     "n_trained": Value("int64"), "length": Value("int64"), "truncated_prompt": Value("bool"),
                     "truncated_response": Value("bool"), "drop_reason": Value("string")})


def drop_reason(prompt: Any, response: Any, response_ids: list[int], n_trained: int) -> str:
    """Why a row cannot be trained on, or "" to keep it."""
    if not isinstance(prompt, str):
        return "missing_prompt"
    if not isinstance(response, str):
        return "missing_response"
    if not (is_text(prompt) and is_text(response)):
        return "invalid_unicode"
    if not response_ids or not response.strip():  # whitespace alone teaches nothing (clean.py drops it too)
        return "empty_response"
    return "no_trained_tokens" if n_trained == 0 else ""


def encode_responses(responses: list[Any], tokenizer) -> list[list[int]]:
    """Token ids of responses (anything that is not text encodes as nothing). Text that spells a special token
    ("<|endoftext|>" quoted in an answer) stays text: an EOS mid-answer would teach the model to stop there."""
    texts = [r if is_text(r) else "" for r in responses]
    return encode_texts(tokenizer, texts, add_special_tokens=False, split_special_tokens=True)


def tokenize_batch(batch: dict[str, list], tokenizer, max_length: int, template: str) -> dict[str, list]:
    """A batched `datasets.map` function: adds input_ids, labels and the bookkeeping columns for every row."""
    prompts = [p if is_text(p) else "" for p in batch["prompt"]]
    prompt_ids = encode_prompts(prompts, tokenizer, template)
    response_ids = encode_responses(batch["response"], tokenizer)
    keep_head = keep_head_for(tokenizer, template)
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "n_trained", "length", "truncated_prompt",
                                            "truncated_response", "drop_reason")}
    for prompt, response, p_ids, r_ids in zip(batch["prompt"], batch["response"], prompt_ids, response_ids):
        example = build_example(p_ids, r_ids, tokenizer.eos_token_id, max_length, keep_head)
        reason = drop_reason(prompt, response, r_ids, example.n_trained)
        out["input_ids"].append(example.input_ids)
        out["labels"].append(example.labels)
        out["n_trained"].append(example.n_trained)
        out["length"].append(len(example.input_ids))
        out["truncated_prompt"].append(example.truncated_prompt)
        out["truncated_response"].append(example.truncated_response)
        out["drop_reason"].append(reason)
    return out


# ---------------------------------------------------------------- loading and splitting

def split_records(ds, val_fraction: float, seed: int):
    """(train, val) by `val_fraction` and `seed`: the same split every time, in training and inference alike."""
    if val_fraction <= 0 or len(ds) < 2:
        return ds, ds.select([])
    n_val = min(len(ds) - 1, max(1, round(len(ds) * val_fraction)))  # both splits keep at least one row
    parts = ds.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def tokenize_by_shape(batch: dict[str, list], tokenizer, max_length: int, template: str, train_turns: str,
                      train_reasoning: bool) -> dict[str, list]:
    """A batched `datasets.map` function over a dataset with a `messages` column: each conversation row by the chat
    template (data/chat.py), each other row as a prompt/response pair by `template` (tokenize_batch), in row
    order."""
    conversation = [messages is not None for messages in batch["messages"]]
    columns = {"prompt": [None] * len(conversation), "response": [None] * len(conversation), **batch}
    parts = []
    for is_conversation in (True, False):
        rows = [i for i, flag in enumerate(conversation) if flag == is_conversation]
        if not rows:
            continue
        sub = {name: [values[i] for i in rows] for name, values in columns.items()}
        out = tokenized_conversations(sub, tokenizer, max_length, train_turns, train_reasoning) if is_conversation \
            else tokenize_batch(sub, tokenizer, max_length, template)
        parts.append((rows, out))
    merged: dict[str, list] = {}
    for rows, out in parts:
        for name, values in out.items():
            column = merged.setdefault(name, [None] * len(conversation))
            for i, value in zip(rows, values):
                column[i] = value
    return merged


def tokenize_dataset(ds, tokenizer, max_length: int, template: str, num_proc: int | None, train_turns: str = "all",
                     train_reasoning: bool = True):
    """`ds` with the tokenized columns: prompt/response rows by `template`, rows with `messages` by the chat
    template with `train_turns` ("all" or "last") of each conversation trained, and their reasoning trained or
    (`train_reasoning` False) kept as context."""
    import datasets

    features = tokenized_features(ds.features)
    if len(ds) == 0:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    shaped = "messages" in ds.column_names
    if shaped:
        require_trainable_chat(tokenizer, template, "conversations")
    # Only the columns tokenizing reads become Python objects; the others (source, index, any field of the records)
    # go from the input's Arrow table to the output's as they are.
    columns = [name for name in ("prompt", "response", "messages", "tools") if name in ds.column_names]
    return ds.map(tokenize_columns, input_columns=columns, batched=True, batch_size=MAP_BATCH, num_proc=num_proc,
                  features=features, desc="tokenizing",
                  fn_kwargs={"names": columns, "shaped": shaped, "tokenizer": tokenizer, "max_length": max_length,
                             "template": template, "train_turns": train_turns, "train_reasoning": train_reasoning})


def tokenize_columns(*values: list, names: list[str], shaped: bool, tokenizer, max_length: int, template: str,
                     train_turns: str, train_reasoning: bool) -> dict[str, list]:
    """The batched `datasets.map` function of tokenize_dataset: the columns `names` (their `values`, in order) as a
    batch for tokenize_by_shape (a dataset with conversations) or tokenize_batch."""
    batch = dict(zip(names, values))
    if shaped:
        return tokenize_by_shape(batch, tokenizer, max_length, template, train_turns, train_reasoning)
    return tokenize_batch(batch, tokenizer, max_length, template)


def effective_num_proc(config: DataSettings, n_rows: int) -> int | None:
    """The worker processes datasets.map gets: None (this process) for small data, whose worker start-up costs more
    than it saves, and for one process, which datasets would otherwise run in a pool of one."""
    if config.streaming or n_rows < 2000:
        return None
    processes = max(1, min(config.num_proc, os.cpu_count() or 1))
    return processes if processes > 1 else None


def column_arrays(ds, names: Sequence[str]) -> dict[str, np.ndarray]:
    """`ds`'s columns `names` as numpy arrays, read from its Arrow table in one piece (row order and any selection
    of rows kept): a column read row by row costs seconds per hundred thousand rows."""
    table = ds.select_columns(list(names)).with_format("arrow")[:]
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in names}


@dataclass
class DataStats:
    count: int
    dropped: dict[str, int]
    truncated_prompt: int
    truncated_response: int
    lengths: dict[str, float]
    trained_fraction: float
    noun: str = "examples"  # what `count` counts: examples, or preference pairs (whose lengths are both answers')
    dropped_by_file: dict[str, dict[str, int]] = field(default_factory=dict)  # {file name: {reason: count}}

    def describe(self, name: str) -> str:
        lens = self.lengths
        dropped = ", ".join(f"{k} {v}{self.files_dropping(k)}" for k, v in self.dropped.items()) or "none"
        if not self.count:
            return f"{name}: 0 {self.noun}; dropped {dropped}"
        return (f"{name}: {self.count} {self.noun}; tokens min {lens['min']:.0f} median {lens['median']:.0f} "
                f"p95 {lens['p95']:.0f} max {lens['max']:.0f}; truncated {self.truncated_prompt} prompts, "
                f"{self.truncated_response} responses (no EOS); dropped {dropped}; "
                f"trained-token fraction {self.trained_fraction:.3f}")

    def files_dropping(self, reason: str) -> str:
        """" (a_clean.jsonl 2, b_clean.jsonl 1)": how many rows each file lost for `reason`, or "" when not known."""
        counts = [f"{name} {reasons[reason]}" for name, reasons in self.dropped_by_file.items() if reason in reasons]
        return f" ({', '.join(counts)})" if counts else ""


def finish_split(tokenized, noun: str = "examples", sources: Sequence[tuple[str, int]] = ()) -> tuple[Any, DataStats]:
    """Drop (and count) unusable rows; compute the statistics of what is kept (`noun` is what a row is). `sources`
    (records.record_sources') attribute each dropped row to its file by its `index`."""
    columns = column_arrays(tokenized, ["drop_reason", "length", "n_trained", "truncated_prompt",
                                        "truncated_response", *(["index"] if sources else [])])
    reasons = columns["drop_reason"]
    dropped_rows = np.flatnonzero(reasons != "")
    dropped: dict[str, int] = {}
    for reason in reasons[dropped_rows]:
        dropped[reason] = dropped.get(reason, 0) + 1
    dropped_by_file: dict[str, dict[str, int]] = {}
    if sources and dropped:
        ends = np.cumsum([count for _, count in sources])
        for index, reason in zip(columns["index"][dropped_rows], reasons[dropped_rows]):
            name = Path(sources[int(np.searchsorted(ends, index, side="right"))][0]).name
            counts = dropped_by_file.setdefault(name, {})
            counts[reason] = counts.get(reason, 0) + 1
    kept_rows = np.flatnonzero(reasons == "")
    kept = tokenized.select(kept_rows) if len(dropped_rows) else tokenized
    lengths = columns["length"][kept_rows] if len(kept_rows) else np.zeros(1)
    trained = int(np.sum(columns["n_trained"][kept_rows]))
    stats = DataStats(
        count=len(kept), dropped=dropped,
        truncated_prompt=int(np.sum(columns["truncated_prompt"][kept_rows])),
        truncated_response=int(np.sum(columns["truncated_response"][kept_rows])),
        lengths={"min": float(lengths.min()), "median": float(np.median(lengths)),
                 "p95": float(np.percentile(lengths, 95)), "max": float(lengths.max()),
                 "mean": float(lengths.mean())},
        trained_fraction=trained / max(1, int(lengths.sum())) if len(kept) else 0.0, noun=noun,
        dropped_by_file=dict(sorted(dropped_by_file.items())),
    )
    return kept, stats


def refuse_unrendered(splits, dataset_path: str) -> None:
    """One UserError for the conversations of the tokenized `splits` whose tool calls or messages the chat template
    leaves out (data/chat.py's unrendered_ drop reasons): trained, they would teach answers without them."""
    found: Counter = Counter()
    first: dict[str, int] = {}
    for split in splits:
        columns = column_arrays(split, ["drop_reason", "index"])
        where = [i for i, reason in enumerate(columns["drop_reason"]) if reason.startswith(UNRENDERED)]
        for reason, index in zip(columns["drop_reason"][where], columns["index"][where]):
            part = reason.removeprefix(UNRENDERED)
            found[part] += 1
            first[part] = min(first.get(part, int(index)), int(index))
    if found:
        part, count = found.most_common(1)[0]
        raise UserError(unrendered_refusal(part, count, record_location(dataset_path, first[part])))


def load_data(config: DataSettings, tokenizer, records=None):
    """Train and validation splits, tokenised, with the statistics of each: ((train, val), (train_stats, val_stats)).
    `records` are load_records' for the config's dataset, when the caller has read them already."""
    assert config.dataset_path is not None  # validate() refuses a config without it
    records = load_records(config.dataset_path, config.revision) if records is None else records
    if len(records) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no records")
    template = resolve_template(config.prompt_template, tokenizer)
    # Tokenized in stored order, then split: the split chooses rows by their number alone (split_records), so each
    # split holds the same rows as the records' split would, while the map reads the records in contiguous batches.
    tokenized = tokenize_dataset(records, tokenizer, config.max_length, template,
                                 effective_num_proc(config, len(records)), config.train_turns, config.train_reasoning)
    refuse_unrendered([tokenized], config.dataset_path)
    sources = record_sources(config.dataset_path)
    splits, stats = [], []
    for split in split_records(tokenized, config.val_fraction, config.seed):
        kept, split_stats = finish_split(split, sources=sources)
        splits.append(kept)
        stats.append(split_stats)
    if len(splits[0]) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no trainable examples remain ({stats[0].dropped})")
    return tuple(splits), tuple(stats)


# ---------------------------------------------------------------- `data.py --show N` and `--dump FILE`

TRAINED_MARKS = ("{+", "+}")  # wdiff's marks for inserted text; with colour on a terminal, green as well
TRAINED_COLOUR = ("\x1b[32m", "\x1b[0m")


def trained_spans(row: dict[str, Any], tokenizer) -> list[tuple[bool, str]]:
    """The example's text in runs of trained and untrained tokens, in order: (trained, text) per run."""
    parts: list[tuple[bool, str]] = []
    current: list[int] = []
    current_masked = None
    for token, label in zip(row["input_ids"], row["labels"]):
        masked = label == IGNORE
        if current and masked != current_masked:
            parts.append((not current_masked, tokenizer.decode(current)))
            current = []
        current.append(token)
        current_masked = masked
    if current:
        parts.append((not current_masked, tokenizer.decode(current)))
    return parts


def show_example(row: dict[str, Any], tokenizer, colour: bool = False) -> str:
    """The example as text, with trained spans between {+ and +} (and green with `colour`), untrained text plain."""
    start, end = TRAINED_MARKS
    if colour:
        start, end = TRAINED_COLOUR[0] + start, end + TRAINED_COLOUR[1]
    return "".join(f"{start}{text}{end}" if trained else text for trained, text in trained_spans(row, tokenizer))


def dump_examples(splits: dict[str, Any], path: str | Path) -> int:
    """One JSON line per example of each split: {"split", "index" (the record's position in dataset_path: its
    0-based line in a single file), "input_ids", "labels"}. Returns the number of lines written."""
    count = 0
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for name, split in splits.items():
            for row in split.select_columns(["index", "input_ids", "labels"]):
                out.write(json.dumps({"split": name, "index": row["index"], "input_ids": row["input_ids"],
                                      "labels": row["labels"]}) + "\n")
                count += 1
    return count
