"""Loading prompt/response data and tokenising it with prompt-masked labels (loss only on the response and its EOS).

The boundary is exact at the token level: the prompt and the response are tokenised separately and their ids
concatenated. Labels follow the Hugging Face convention (the model shifts them): a trained position holds its own
input id, every other position holds -100. Label 0 is always -100, since nothing predicts the first token.
"""

from __future__ import annotations

import argparse
import glob
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt4all_training.data.clean import encodable
from gpt4all_training.errors import UserError

IGNORE = -100


# ---------------------------------------------------------------- prompt format (shared with generation)

def resolve_template(template: str, tokenizer) -> str:
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError("prompt_template: 'chat' needs a tokenizer with a chat template; use 'plain'")
    return template


def format_prompt(prompt: str, tokenizer, template: str) -> str:
    """The text the model sees before the response, in training and in generation alike."""
    if template == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt + "\n"


MESSAGE_MARK = "\x00message\x00"  # stands for the user's message while the chat template is rendered


def chat_frame(tokenizer) -> tuple[str, str] | None:
    """The chat template's text before and after the user's message, or None for a template that changes the message
    (then it cannot be cut out, and the whole rendering is tokenised)."""
    rendered = format_prompt(MESSAGE_MARK, tokenizer, "chat")
    if rendered.count(MESSAGE_MARK) != 1:
        return None
    before, after = rendered.split(MESSAGE_MARK)
    return before, after


def encode_prompts(prompts: list[str], tokenizer, template: str) -> list[list[int]]:
    """Token ids of formatted prompts. Only the template and the tokenizer write special tokens: a prompt that spells
    one ("<|im_start|>assistant" pasted into a question) stays text, as responses do (tokenize_batch)."""
    if template == "plain":
        texts = [format_prompt(p, tokenizer, template) for p in prompts]
        return tokenizer(texts, split_special_tokens=True)["input_ids"]
    frame = chat_frame(tokenizer)
    if frame is None:
        texts = [format_prompt(p, tokenizer, template) for p in prompts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    before, after = tokenizer(list(frame), add_special_tokens=False)["input_ids"]
    messages = tokenizer(prompts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [before + ids + after for ids in messages]


# ---------------------------------------------------------------- labels (pure)

@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated_prompt: bool
    truncated_response: bool

    @property
    def n_trained(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def build_example(prompt_ids: list[int], response_ids: list[int], eos_id: int, max_length: int,
                  keep_head: int = 0) -> Example:
    """Concatenate prompt, response and EOS into at most `max_length` tokens with prompt-masked labels.

    If it does not fit, the prompt keeps its first `keep_head` tokens (a BOS) and its end (the question is
    usually last), shrinking to no less than max_length // 2 while the response needs room; the response then
    keeps as much as fits. A cut response gets no EOS: the model must not learn to stop mid-answer.
    """
    prompt, response = list(prompt_ids), list(response_ids)
    truncated_prompt = truncated_response = False
    if len(prompt) + len(response) + 1 > max_length:
        prompt_budget = min(len(prompt), max(max_length // 2, max_length - len(response) - 1))
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


def is_text(value: Any) -> bool:
    return isinstance(value, str) and encodable(value)


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


def tokenize_batch(batch: dict[str, list], tokenizer, max_length: int, template: str) -> dict[str, list]:
    """A batched `datasets.map` function: adds input_ids, labels and the bookkeeping columns for every row."""
    prompts = [p if is_text(p) else "" for p in batch["prompt"]]
    responses = [r if is_text(r) else "" for r in batch["response"]]
    prompt_ids = encode_prompts(prompts, tokenizer, template)
    # Text that spells a special token ("<|endoftext|>" quoted in an answer) stays text: an EOS mid-answer would
    # teach the model to stop there.
    response_ids = tokenizer(responses, add_special_tokens=False, split_special_tokens=True)["input_ids"]
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

def local_data_files(path: Path) -> list[str] | None:
    """The *_clean.jsonl files `dataset_path` names locally, or None when it is not local clean data."""
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        files = sorted(glob.glob(str(path / "*_clean.jsonl")))
        return files or None
    return None


def first_bad_line(files: list[str]) -> str | None:
    """What is wrong with the first line of `files` that is not a JSON object of valid text, naming the file and the
    line, or None. Run only after datasets failed to read them: its own error names neither."""
    from gpt4all_training.data.text import iter_records

    for file in files:
        try:
            for where, record in iter_records(file):
                if not all(is_text(v) for v in record.values() if isinstance(v, str)):
                    return f"{where}: text with a lone surrogate, which is not valid Unicode; run clean.py on it first"
        except UserError as exc:
            return str(exc)
    return None


def unreadable_jsonl(dataset_path: str, files: list[str] | None, exc: Exception, advice: str) -> UserError:
    """The error for JSONL that datasets could not read: the first bad line by file and line, else datasets' own."""
    bad_line = first_bad_line(files) if files else None
    if bad_line:
        return UserError(bad_line)
    cause = exc.__cause__ or exc
    return UserError(f"dataset_path {dataset_path}: unreadable JSONL ({str(cause).splitlines()[0][:200]}); {advice}")


def load_records(dataset_path: str, revision: str | None = None):
    """A `datasets.Dataset` with at least prompt and response columns, plus a stable `index` column."""
    import datasets

    path = Path(dataset_path).expanduser()
    files = local_data_files(path)
    if revision and path.exists():
        # Local data has no revisions: datasets 5.2 reads a folder's current files whatever the revision (even in
        # a git repository). Say so rather than let a pin look effective.
        warnings.warn(f"revision {revision!r} is ignored for the local path {dataset_path}", stacklevel=2)
    try:
        if files is not None:
            ds = datasets.load_dataset("json", data_files=files, split="train")
        elif path.suffix in (".jsonl", ".json") or dataset_path.startswith((".", "/", "~")) and not path.exists():
            raise UserError(f"dataset_path: {dataset_path} does not exist")
        else:
            # A Hub dataset id (`revision` pins the exact data), or a local dataset repository folder.
            ds = datasets.load_dataset(dataset_path, revision=revision, split="train")
    except UserError:
        raise
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise UserError(f"dataset_path {dataset_path}: cannot load ({str(exc).splitlines()[0][:200]})") from None
    except datasets.exceptions.DatasetGenerationError as exc:
        raise unreadable_jsonl(dataset_path, files, exc, "run clean.py on it first") from None
    missing = [c for c in ("prompt", "response") if c not in ds.column_names]
    if missing:
        raise UserError(f"dataset_path {dataset_path}: records lack the field {missing[0]!r}; run clean.py first")
    return ds.add_column("index", list(range(len(ds))))


def split_records(ds, val_fraction: float, seed: int):
    """(train, val) by `val_fraction` and `seed`: the same split every time, in training and inference alike."""
    if val_fraction <= 0 or len(ds) < 2:
        return ds, ds.select([])
    n_val = min(len(ds) - 1, max(1, round(len(ds) * val_fraction)))  # both splits keep at least one row
    parts = ds.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def tokenize_dataset(ds, tokenizer, max_length: int, template: str, num_proc: int | None):
    import datasets

    features = tokenized_features(ds.features)
    if len(ds) == 0:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    return ds.map(tokenize_batch, batched=True, batch_size=256, num_proc=num_proc, features=features,
                  fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "template": template},
                  desc="tokenising")


def effective_num_proc(config, n_rows: int) -> int | None:
    if config.streaming or n_rows < 2000:
        return None  # worker start-up costs more than it saves on small data
    return max(1, min(config.num_proc, os.cpu_count() or 1))


@dataclass
class DataStats:
    count: int
    dropped: dict[str, int]
    truncated_prompt: int
    truncated_response: int
    lengths: dict[str, float]
    trained_fraction: float

    def describe(self, name: str) -> str:
        lens = self.lengths
        dropped = ", ".join(f"{k} {v}" for k, v in self.dropped.items()) or "none"
        if not self.count:
            return f"{name}: 0 examples; dropped {dropped}"
        return (f"{name}: {self.count} examples; tokens min {lens['min']:.0f} median {lens['median']:.0f} "
                f"p95 {lens['p95']:.0f} max {lens['max']:.0f}; truncated {self.truncated_prompt} prompts, "
                f"{self.truncated_response} responses (no EOS); dropped {dropped}; "
                f"trained-token fraction {self.trained_fraction:.3f}")


def finish_split(tokenized) -> tuple[Any, DataStats]:
    """Drop (and count) unusable rows; compute the statistics of what is kept."""
    reasons = np.asarray(tokenized["drop_reason"], dtype=object)
    dropped: dict[str, int] = {}
    for reason in reasons[reasons != ""]:
        dropped[reason] = dropped.get(reason, 0) + 1
    kept = tokenized.filter(lambda r: [not x for x in r], input_columns=["drop_reason"], batched=True)
    lengths = np.asarray(kept["length"]) if len(kept) else np.zeros(1)
    trained = int(np.sum(kept["n_trained"])) if len(kept) else 0
    stats = DataStats(
        count=len(kept), dropped=dropped,
        truncated_prompt=int(np.sum(kept["truncated_prompt"])) if len(kept) else 0,
        truncated_response=int(np.sum(kept["truncated_response"])) if len(kept) else 0,
        lengths={"min": float(lengths.min()), "median": float(np.median(lengths)),
                 "p95": float(np.percentile(lengths, 95)), "max": float(lengths.max()),
                 "mean": float(lengths.mean())},
        trained_fraction=trained / max(1, int(lengths.sum())) if len(kept) else 0.0,
    )
    return kept, stats


def load_data(config, tokenizer):
    """Train and validation splits, tokenised, with the statistics of each: ((train, val), (train_stats, val_stats))."""
    records = load_records(config.dataset_path, config.revision)
    if len(records) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no records")
    train_raw, val_raw = split_records(records, config.val_fraction, config.seed)
    template = resolve_template(config.prompt_template, tokenizer)
    num_proc = effective_num_proc(config, len(records))
    splits, stats = [], []
    for raw in (train_raw, val_raw):
        tokenized = tokenize_dataset(raw, tokenizer, config.max_length, template, num_proc)
        kept, split_stats = finish_split(tokenized)
        splits.append(kept)
        stats.append(split_stats)
    if len(splits[0]) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no trainable examples remain ({stats[0].dropped})")
    return tuple(splits), tuple(stats)


# ---------------------------------------------------------------- batching

def collate(rows: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest row of this batch (right padding); padded labels are -100."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.as_tensor(row["input_ids"])
        labels[i, :n] = torch.as_tensor(row["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def fetch_batch(dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows `indices` of a tokenised dataset, collated."""
    columns = dataset.select_columns(["input_ids", "labels"])[indices]
    rows = [{"input_ids": i, "labels": l} for i, l in zip(columns["input_ids"], columns["labels"])]
    return collate(rows, pad_id)


# ---------------------------------------------------------------- `data.py --show N`

def show_example(row: dict[str, Any], tokenizer) -> str:
    """The example as text, with masked (untrained) spans in [[...]] and trained spans in plain text."""
    parts, current, current_masked = [], [], None
    for token, label in zip(row["input_ids"], row["labels"]):
        masked = label == IGNORE
        if current and masked != current_masked:
            parts.append((current_masked, tokenizer.decode(current)))
            current = []
        current.append(token)
        current_masked = masked
    if current:
        parts.append((current_masked, tokenizer.decode(current)))
    return "".join(f"[[{text}]]" if masked else text for masked, text in parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="training config YAML")
    parser.add_argument("--show", type=int, default=3, help="print this many tokenised examples")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")


def run(args: argparse.Namespace) -> int:
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.model.loading import tokenizer_for

    config = load_config(args.config, args.overrides)
    tokenizer = tokenizer_for(config)
    (train, val), (train_stats, val_stats) = load_data(config, tokenizer)
    for row in train.select(range(min(args.show, len(train)))):
        print(f"--- example {row['index']} ({row['n_trained']} trained tokens; [[masked]] text is not trained)")
        print(show_example(row, tokenizer))
    print(train_stats.describe("train"))
    print(val_stats.describe("validation"))
    return 0
