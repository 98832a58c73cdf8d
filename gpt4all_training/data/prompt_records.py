"""Prompts to sample completions for (objective grpo), each with the fields its rewards read.

A cleaned prompt record is `{"prompt", "source", ...}`: the prompt as text or as a list of messages ending with a
user turn (TRL's prompt-only shape, in its standard and conversational forms), and any other fields as they were
(`answer`, `tests`, ...), which the rewards get as keyword arguments. `clean.py --prompts` writes them
(`prompt_record`), counting what it drops; training reads them (`load_prompts`), dropping and counting what cannot
be sampled from: a prompt longer than max_length tokens is dropped rather than cut (a cut question is another
question). A text prompt is written as sft writes one (the plain template or the chat template's user turn), a
conversation through the chat template, both with the generation prompt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gpt4all_training.data.chat import ChatEncoder, require_trainable_chat
from gpt4all_training.data.conversations import conversation_problem, is_text, message, template_messages
from gpt4all_training.data.prompts import encode_prompts, resolve_template
from gpt4all_training.data.records import iter_records, local_data_files
from gpt4all_training.data.settings import DataSettings
from gpt4all_training.data.sft import split_records
from gpt4all_training.errors import UserError

# The keyword arguments a reward is called with besides the records' fields (TRL's names): a field may not take them.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


# ---------------------------------------------------------------- one prompt

def prompt_problem(prompt: Any) -> str | None:
    """The drop reason for a prompt (text, or messages ending with the user's turn), or None when it can be
    sampled from."""
    if isinstance(prompt, str):
        if not is_text(prompt):
            return "invalid_unicode"
        return None if prompt.strip() else "empty_prompt"
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
        return "malformed_messages"
    if prompt[-1].get("role") != "user":
        return "last_turn_not_user"
    return conversation_problem([*prompt, {"role": "assistant", "content": "answer"}])


def prompt_record(obj: dict[str, Any], source: str) -> dict[str, Any] | str:
    """A raw record read as a prompt (clean.py --prompts): its `prompt` (text or messages), or its `messages`
    ending with the user's turn, with every other field kept; or the drop reason."""
    if "prompt" in obj:
        prompt, rest = obj["prompt"], {k: v for k, v in obj.items() if k != "prompt"}
    elif "messages" in obj:
        prompt, rest = obj["messages"], {k: v for k, v in obj.items() if k != "messages"}
    else:
        return "missing_prompt"
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        prompt = [message(m.get("role"), m.get("content"), m) for m in prompt]
    elif not isinstance(prompt, str):
        return "non_string_prompt"
    problem = prompt_problem(prompt)
    if problem:
        return problem
    taken = [name for name in REWARD_ARGUMENTS if name in rest]
    if taken:
        return f"field_named_{taken[0]}"
    own = rest.pop("source", None)
    return {"prompt": prompt, "source": own if isinstance(own, str) else source, **rest}


# ---------------------------------------------------------------- the records training reads

def prompt_rows(dataset_path: str, revision: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of every prompt record, local *_clean.jsonl line by line or a Hub dataset's rows; a record
    without a prompt, or with a field named like a reward argument, is a one-line UserError naming it."""
    path = Path(dataset_path).expanduser()
    files = local_data_files(path)
    if path.is_dir() and files is None:
        raise UserError(f"dataset_path {dataset_path}: no *_clean.jsonl files in the folder; run clean.py --prompts "
                        f"on the raw prompts first")
    sources = [iter_records(f) for f in files] if files is not None else [iter_records(dataset_path, revision)]
    for source in sources:
        for where, record in source:
            if "prompt" not in record:
                present = ", ".join(map(str, record)) or "none"
                raise UserError(f"{where}: no 'prompt' field (fields: {present}); run clean.py --prompts on the raw "
                                f"prompts first")
            if not isinstance(record["prompt"], (str, list)):
                raise UserError(f"{where}: field 'prompt' is {type(record['prompt']).__name__}, not text or a list "
                                f"of messages")
            taken = [name for name in REWARD_ARGUMENTS if name in record]
            if taken:
                raise UserError(f"{where}: a field is named {taken[0]!r}, which is what the rewards' own argument "
                                f"is called; rename the field")
            yield where, record


def fields_of(record: dict[str, Any]) -> dict[str, Any]:
    """What the rewards get of a record besides its prompt."""
    return {k: v for k, v in record.items() if k != "prompt"}


@dataclass
class PromptStats:
    """A split of prompts: how many, their token lengths, and what was dropped by reason."""
    count: int
    dropped: dict[str, int]
    lengths: dict[str, float]
    noun: str = "prompts"

    def describe(self, name: str) -> str:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        if not self.count:
            return f"{name}: 0 prompts; dropped {dropped}"
        lens = self.lengths
        return (f"{name}: {self.count} prompts; tokens min {lens['min']:.0f} median {lens['median']:.0f} "
                f"p95 {lens['p95']:.0f} max {lens['max']:.0f}; dropped {dropped}")


@dataclass
class Prompts:
    """A split of prompts ready to sample from: per prompt its token ids (with the generation prompt), the prompt
    as the record holds it, the record's other fields and its position in the data."""
    ids: list[list[int]] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    fields: list[dict[str, Any]] = field(default_factory=list)
    index: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.ids]


def prompts_fingerprint(records: list[dict[str, Any]]) -> str:
    """SHA-256 of the records in stored order: what a resumed run compares."""
    digest = hashlib.sha256(b"prompts\n")
    for record in records:
        digest.update(json.dumps(record, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()


def encode_prompt_records(records: list[dict[str, Any]], tokenizer, template: str) -> list[list[int] | str]:
    """Each record's prompt ids with the generation prompt, or its drop reason: text by `template` (as sft writes
    a prompt), messages through the chat template."""
    out: list[list[int] | str] = [prompt_problem(r["prompt"]) or [] for r in records]
    texts = [i for i, r in enumerate(records) if out[i] == [] and isinstance(r["prompt"], str)]
    chats = [i for i, r in enumerate(records) if out[i] == [] and isinstance(r["prompt"], list)]
    if texts:  # the tokenizer refuses an empty batch
        for i, ids in zip(texts, encode_prompts([records[i]["prompt"] for i in texts], tokenizer, template)):
            out[i] = ids
    if chats:
        require_trainable_chat(tokenizer, template, "prompts written as messages")
        encoded = ChatEncoder(tokenizer).encode([template_messages(records[i]["prompt"]) for i in chats],
                                                [True] * len(chats))
        for i, chat_ids in zip(chats, encoded):
            out[i] = chat_ids if chat_ids is not None else "template_refused"
    return out


def prompt_split(records: list[dict[str, Any]], positions: list[int], encoded: list[list[int] | str],
                 max_length: int) -> tuple[Prompts, PromptStats]:
    """The prompts at `positions` that can be sampled from, and the split's statistics (every dropped one counted
    by its reason)."""
    kept, dropped = Prompts(), dict[str, int]()
    for position in positions:
        ids = encoded[position]
        if isinstance(ids, str) or len(ids) > max_length:
            reason = ids if isinstance(ids, str) else "prompt_too_long"
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        kept.ids.append(ids)
        kept.prompts.append(records[position]["prompt"])
        kept.fields.append(fields_of(records[position]))
        kept.index.append(position)
    lengths = np.asarray(kept.lengths() or [0])
    stats = PromptStats(len(kept), dropped, {"min": float(lengths.min()), "median": float(np.median(lengths)),
                                             "p95": float(np.percentile(lengths, 95)), "max": float(lengths.max())})
    return kept, stats


def load_prompts(config: DataSettings, tokenizer
                 ) -> tuple[tuple[Prompts, Prompts], tuple[PromptStats, PromptStats], str]:
    """((train, val), (their statistics), the records' fingerprint), split as sft splits its records (val_fraction,
    seed); a run that keeps no training prompt is an error."""
    import datasets

    assert config.dataset_path is not None  # validate() refuses a config without it
    records = [record for _, record in prompt_rows(config.dataset_path, config.revision)]
    if not records:
        raise UserError(f"dataset_path {config.dataset_path}: no records; run clean.py --prompts on the raw prompts "
                        f"and check what it kept")
    train_raw, val_raw = split_records(datasets.Dataset.from_dict({"position": list(range(len(records)))}),
                                       config.val_fraction, config.seed)
    encoded = encode_prompt_records(records, tokenizer, resolve_template(config.prompt_template, tokenizer))
    (train, train_stats), (val, val_stats) = (prompt_split(records, split["position"], encoded, config.max_length)
                                              for split in (train_raw, val_raw))
    if not len(train):
        raise UserError(f"dataset_path {config.dataset_path}: no prompt can be sampled from "
                        f"({', '.join(f'{k} {v}' for k, v in sorted(train_stats.dropped.items()))}); prompts longer "
                        f"than max_length ({config.max_length}) tokens are dropped")
    return (train, val), (train_stats, val_stats), prompts_fingerprint(records)
