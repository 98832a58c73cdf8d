"""Preference pairs tokenized for training (objective dpo): each answer becomes an example with the prompt before it,
labelled exactly as sft labels a response, or, for message pairs, as data/chat.py labels the assistant turns.

The two answers of a pair share one prompt, token for token: a text prompt too long for max_length is cut once, by
the longer answer's needs, and a conversation loses the same rounds in both. A pair whose answers end up identical,
whose prompts differ all the same, or with nothing left to train is dropped and counted.

A micro-batch of B pairs (`fetch_pairs`) is one padded batch of 2B rows: the chosen answers first, then the rejected
ones in the same order, so a pair never spans micro-batches and row i + B is row i's rival. Precomputed reference
log-probabilities ride along as `reference_logps`, one per row.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator

import torch

from gpt4all_training.batch import IGNORE
from gpt4all_training.data.batching import collate
from gpt4all_training.data.chat import (ChatEncoder, ConversationExample, Messages, conversation_messages,
                                        require_trainable_chat)
from gpt4all_training.data.conversations import is_text
from gpt4all_training.data.preferences import PAIR_FIELDS, pair_problem, record_problem
from gpt4all_training.data.prompts import encode_prompts, resolve_template
from gpt4all_training.data.records import iter_records, local_data_files
from gpt4all_training.data.settings import DataSettings
from gpt4all_training.data.sft import (DataStats, build_example, effective_num_proc, encode_responses, finish_split,
                                       keep_head_for, split_records)
from gpt4all_training.errors import UserError

# The reference log-probabilities of a pair's two answers, once precomputed.
REFERENCE_COLUMNS = ("reference_chosen", "reference_rejected")
ANSWER_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
EMPTY = ConversationExample([], [], 0, False)  # the answers of a dropped pair


# ---------------------------------------------------------------- the records

def preference_rows(dataset_path: str, revision: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, {prompt, chosen, rejected}) of every record, local *_clean.jsonl line by line or a Hub dataset's rows,
    each checked: a missing field or a wrong type is a one-line UserError naming the file and line (or record)."""
    path = Path(dataset_path).expanduser()
    files = local_data_files(path)
    if path.is_dir() and files is None:
        raise UserError(f"dataset_path {dataset_path}: no *_clean.jsonl files in the folder; run clean.py on the raw "
                        f"preference data first")
    sources = [iter_records(str(f)) for f in files] if files is not None else [iter_records(dataset_path, revision)]
    for where, record in itertools.chain(*sources):
        problem = record_problem(record)
        if problem:
            raise UserError(f"{where}: {problem}")
        yield where, {name: record[name] for name in PAIR_FIELDS}


def load_preference_records(dataset_path: str, revision: str | None = None):
    """Preference data as a `datasets.Dataset` of prompt, chosen and rejected, with a stable `index`. When some pairs
    are messages, the text pairs become a user turn and an assistant turn, as a mixed sft dataset treats its
    prompt/response rows (one column cannot hold both types)."""
    import datasets

    rows = [row for _, row in preference_rows(dataset_path, revision)]
    if not rows:
        raise UserError(f"dataset_path {dataset_path}: no records; run clean.py on the raw preference data and check "
                        f"what it kept")
    if any(isinstance(row["chosen"], list) for row in rows):
        rows = [row if isinstance(row["chosen"], list) else as_message_pair(row) for row in rows]
    return datasets.Dataset.from_list([{**row, "index": index} for index, row in enumerate(rows)])


def as_message_pair(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    return {"prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}]}


# ---------------------------------------------------------------- tokenizing

def pair_features(features):
    """`features` plus the columns the pair tokenizers add. Declared, so that an empty split has them too."""
    from datasets import Features, List, Value

    return Features({**features, **{name: List(Value("int32" if name.endswith("ids") else "int64"))
                                    for name in ANSWER_COLUMNS},
                     "n_trained": Value("int64"), "length": Value("int64"), "truncated_prompt": Value("bool"),
                     "truncated_response": Value("bool"), "drop_reason": Value("string")})


def pair_columns(examples: list[tuple[Any, Any, bool, bool, str]]) -> dict[str, list]:
    """The added columns of a batch, from (chosen example, rejected example, truncated prompt, truncated answer,
    drop reason) per pair; the examples have input_ids and labels."""
    out: dict[str, list] = {name: [] for name in (*ANSWER_COLUMNS, "n_trained", "length", "truncated_prompt",
                                                  "truncated_response", "drop_reason")}
    for chosen, rejected, truncated_prompt, truncated_answer, reason in examples:
        for name, example in (("chosen", chosen), ("rejected", rejected)):
            out[f"{name}_input_ids"].append(example.input_ids)
            out[f"{name}_labels"].append(example.labels)
        out["n_trained"].append(chosen.n_trained + rejected.n_trained)
        out["length"].append(len(chosen.input_ids) + len(rejected.input_ids))
        out["truncated_prompt"].append(truncated_prompt)
        out["truncated_response"].append(truncated_answer)
        out["drop_reason"].append(reason)
    return out


def rival_problem(chosen, rejected) -> str:
    """Why two labelled answers of one pair cannot be trained on together, or ""."""
    if not chosen.n_trained or not rejected.n_trained:
        return "no_trained_tokens"
    if chosen.input_ids == rejected.input_ids:
        return "identical_answers"
    if prompt_part(chosen) != prompt_part(rejected):
        return "prompts_differ"
    return ""


def prompt_part(example) -> list[int]:
    """The ids before the first trained position."""
    first = next(i for i, label in enumerate(example.labels) if label != IGNORE)
    return example.input_ids[:first]


def tokenize_text_pairs(batch: dict[str, list], tokenizer, max_length: int, template: str) -> dict[str, list]:
    """A batched `datasets.map` function over text pairs: each answer as sft's tokenize_batch makes a response."""
    prompt_ids = encode_prompts([p if is_text(p) else "" for p in batch["prompt"]], tokenizer, template)
    chosen_ids, rejected_ids = (encode_responses(batch[name], tokenizer) for name in ("chosen", "rejected"))
    keep_head = keep_head_for(tokenizer, template)
    examples: list[tuple[Any, Any, bool, bool, str]] = []
    for prompt, chosen, rejected, p_ids, c_ids, r_ids in zip(batch["prompt"], batch["chosen"], batch["rejected"],
                                                             prompt_ids, chosen_ids, rejected_ids):
        room = max(len(c_ids), len(r_ids))
        first, second = (build_example(p_ids, ids, tokenizer.eos_token_id, max_length, keep_head, room)
                         for ids in (c_ids, r_ids))
        reason = pair_problem(prompt, chosen, rejected) or rival_problem(first, second)
        examples.append((first, second, first.truncated_prompt,
                         first.truncated_response or second.truncated_response, reason))
    return pair_columns(examples)


def tokenize_message_pairs(batch: dict[str, list], tokenizer, max_length: int, train_turns: str) -> dict[str, list]:
    """A batched `datasets.map` function over message pairs: prompt + answer rendered as one conversation, its
    answer's assistant turns trained (`train_turns` "last": the answer's last one), as data/chat.py trains them."""
    encoder = ChatEncoder(tokenizer)
    results: list[Any] = []
    conversations: list[Messages] = []
    flags: list[list[bool]] = []
    for prompt, chosen, rejected in zip(batch["prompt"], batch["chosen"], batch["rejected"]):
        parsed = [conversation_messages({"messages": [*prompt, *answer]}) for answer in (chosen, rejected)]
        answers = [p for p in parsed if not isinstance(p, str)]
        problem = pair_problem(prompt, chosen, rejected) or next((p for p in parsed if isinstance(p, str)), None)
        results.append(problem or len(conversations))
        if not problem:
            for messages, trained in answers:
                conversations.append(messages)
                flags.append(answer_flags(trained, len(prompt), train_turns))
    labelled = encoder.examples(conversations, flags, max_length)
    # Both answers must lose the same rounds, or their prompts would differ: the one that lost fewer loses more.
    for i in range(0, len(labelled), 2):
        first, second = labelled[i:i + 2]
        if isinstance(first, str) or isinstance(second, str) or first.dropped_rounds == second.dropped_rounds:
            continue
        fewer = i + int(second.dropped_rounds < first.dropped_rounds)
        rounds = max(first.dropped_rounds, second.dropped_rounds)
        [labelled[fewer]] = encoder.examples([conversations[fewer]], [flags[fewer]], max_length, [rounds])
    examples: list[tuple[Any, Any, bool, bool, str]] = []
    for result in results:
        if isinstance(result, str):
            examples.append((EMPTY, EMPTY, False, False, result))
            continue
        first, second = labelled[result:result + 2]
        if isinstance(first, str):  # a drop reason
            examples.append((EMPTY, EMPTY, False, False, first))
        elif isinstance(second, str):
            examples.append((EMPTY, EMPTY, False, False, second))
        else:
            examples.append((first, second, first.dropped_rounds > 0, first.cut_turn or second.cut_turn,
                             rival_problem(first, second)))
    return pair_columns(examples)


def answer_flags(trained: list[bool], prompt_length: int, train_turns: str) -> list[bool]:
    """Which turns of prompt + answer are trained: the answer's assistant turns (train_turns "last": its last one),
    never the prompt's."""
    flags = [False] * prompt_length + trained[prompt_length:]
    if train_turns == "last" and any(flags):
        last = max(i for i, flag in enumerate(flags) if flag)
        flags = [i == last for i in range(len(flags))]
    return flags


def tokenize_pairs(ds, tokenizer, max_length: int, template: str, num_proc: int | None, train_turns: str):
    """`ds` with the tokenized columns of both answers: text pairs by `template`, message pairs by the chat
    template."""
    import datasets

    features = pair_features(ds.features)
    if len(ds) == 0:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    if isinstance(ds[0]["chosen"], list):
        require_trainable_chat(tokenizer, template, "message pairs")
        return ds.map(tokenize_message_pairs, batched=True, batch_size=256, num_proc=num_proc, features=features,
                      fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "train_turns": train_turns},
                      desc="tokenizing preference pairs")
    return ds.map(tokenize_text_pairs, batched=True, batch_size=256, num_proc=num_proc, features=features,
                  fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "template": template},
                  desc="tokenizing preference pairs")


def load_pair_data(config: DataSettings, tokenizer, records) -> tuple[tuple, tuple[DataStats, DataStats]]:
    """Train and validation pairs, tokenized, with the statistics of each, split as sft splits its records."""
    train_raw, val_raw = split_records(records, config.val_fraction, config.seed)
    template = resolve_template(config.prompt_template, tokenizer)
    num_proc = effective_num_proc(config, len(records))
    splits, stats = [], []
    for raw in (train_raw, val_raw):
        tokenized = tokenize_pairs(raw, tokenizer, config.max_length, template, num_proc, config.train_turns)
        kept, split_stats = finish_split(tokenized, noun="pairs")
        splits.append(kept)
        stats.append(split_stats)
    if len(splits[0]) == 0:
        raise UserError(f"dataset_path {config.dataset_path}: no trainable pairs remain ({stats[0].dropped})")
    return (splits[0], splits[1]), (stats[0], stats[1])


# ---------------------------------------------------------------- micro-batches

def fetch_pairs(dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Pairs `indices` as one padded micro-batch: the chosen answers, then the rejected ones; with their reference
    log-probabilities (`reference_logps`, float32, in the same row order) when the dataset holds them."""
    names = [*ANSWER_COLUMNS, *(c for c in REFERENCE_COLUMNS if c in dataset.column_names)]
    columns = dataset.select_columns(names)[indices]
    examples = [{"input_ids": ids, "labels": labels} for answer in ("chosen", "rejected")
                for ids, labels in zip(columns[f"{answer}_input_ids"], columns[f"{answer}_labels"])]
    batch = collate(examples, pad_id)
    if REFERENCE_COLUMNS[0] in columns:
        batch["reference_logps"] = torch.tensor([*columns[REFERENCE_COLUMNS[0]], *columns[REFERENCE_COLUMNS[1]]],
                                                dtype=torch.float32)
    return batch


def pair_count(batch: dict[str, torch.Tensor]) -> int:
    """Pairs in a micro-batch of fetch_pairs."""
    return batch["input_ids"].shape[0] // 2
