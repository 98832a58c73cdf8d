"""What a run trains on and how it is scored, chosen once from `config.objective`.

An objective is a small object behind the `Objective` protocol: its data, its model, what it computes with the model
before step 1, its sampler, how a micro-batch is fetched, its loss and what the loss is a sum over (the step divides
by that count), its per-window metrics and validation, what `plan` counts and what `check` reads.
`objective_for(config)` is the one place that reads `config.objective`; train(), plan and check each call it once.
Adding an objective means adding a class here (and its choice to the config), never touching the loop.

- "sft": prompt/response records, the loss on the response (data/sft.py); or conversations (records with
  `messages`, detected from the data), the loss on the assistant turns (data/chat.py).
- "causal_lm": raw text joined with EOS and cut into rows of max_length, every token trained (data/text.py).
- "dpo": prompt/chosen/rejected pairs (data/pairs.py), DPO, IPO or SimPO over the answers' log-probabilities against
  a reference (training/preference.py); the step's loss is a mean over pairs, not tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from gpt4all_training.batch import trained_token_count
from gpt4all_training.data.batching import batch_fetcher, fetch_rows
from gpt4all_training.data.cache import cache_entry, cached_splits
from gpt4all_training.data.conversations import conversation_problem
from gpt4all_training.data.pairs import (fetch_pairs, load_pair_data, load_preference_records, pair_count,
                                         preference_rows)
from gpt4all_training.data.preferences import PAIR_FIELDS, pair_problem
from gpt4all_training.data.records import (finetune_records, iter_records, load_records, record_text,
                                           records_fingerprint)
from gpt4all_training.data.sampling import StepSampler, row_sampler
from gpt4all_training.data.sft import load_data
from gpt4all_training.data.text import load_pretrain_data
from gpt4all_training.errors import UserError
from gpt4all_training.model.from_config import build_model_from_config
from gpt4all_training.model.loading import load_model
from gpt4all_training.training.counts import DataPlan, TokenCounts, count_run_tokens, run_layout
from gpt4all_training.training.evaluate import TokenValidation, Validation
from gpt4all_training.training.loss import CausalLMLoss, token_loss_sum
from gpt4all_training.training.preference import (REFERENCES, PairValidation, PreferenceLoss, PreferenceSettings,
                                                  attach_reference, disable_dropout, frozen_copy, reference_kind)

Batch = dict[str, torch.Tensor]
# Prompt/response fields every fine-tuning record needs.
FINETUNE_FIELDS = ("prompt", "response")


@dataclass
class Data:
    train: Any  # what the sampler's indices pick from: a tokenized dataset, or a row store
    val: Any  # a tokenized dataset that the objective's validation reads
    train_stats: Any  # each has describe(name), the line the loop prints
    val_stats: Any
    # SHA-256 of the records (or, for raw text, of their tokens) that a resume compares; None for a stream, which is
    # not read in full before training.
    fingerprint: str | None = None


@dataclass
class RecordScan:
    """What `check` learns from reading the records: how many, a sample for its dry run (which needs `min_sample`
    of them), which fields were read."""
    count: int
    sample: list[dict[str, Any]]
    min_sample: int
    fields: str


class Objective(Protocol):
    name: str
    example_noun: str  # what one sampled example is: "examples", "rows" or "pairs"
    dry_run_file: str  # the name `check` gives its sample, so that the data loader reads it as this objective's
    loss: Callable[[Any, Batch], torch.Tensor]  # a micro-batch's loss, summed over what `count` counts
    count: Callable[[Batch], int]  # what the loss sums over (trained tokens, pairs): the step divides by its total
    validation: Validation  # what validation measures

    def load_data(self, config, tokenizer, log: Callable[[str], Any], world_size: int) -> Data: ...

    def build_model(self, config, tokenizer): ...

    def before_training(self, model, data: Data, backend, pad_id: int, log: Callable[[str], Any]) -> None:
        """Work on the prepared model before step 1, while it holds the initial weights (a resume loads its
        checkpoint afterwards): dpo's reference. It may add columns to `data`'s splits."""
        ...

    def sampler(self, config, data: Data, world_size: int, rank: int): ...

    def fetch(self, dataset, indices: list[int], pad_id: int) -> Batch: ...

    def window_metrics(self, backend) -> dict[str, float]: ...

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str: ...

    def plan_counts(self, config, data: Data, sampler, total_steps: int) -> DataPlan: ...

    def scan_records(self, config, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan: ...

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str: ...


def pretrained_model(config):
    """model_name's weights in fp32 (the master weights, whatever the compute dtype)."""
    return load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                      torch.float32, config.gradient_checkpointing)


def epochs_line(sampler, total_steps: int, num_epochs: int, noun: str = "examples") -> str:
    return (f"{total_steps} optimiser steps: {sampler.steps_per_epoch} per epoch x {num_epochs} epochs "
            f"(global batch {sampler.examples_per_step} {noun})")


def record_problem(record: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    for name in fields:
        if name not in record:
            present = ", ".join(map(str, record)) or "none"
            return f"no {name!r} field (fields: {present}); run clean.py on the raw data first"
        if not isinstance(record[name], str):
            return f"field {name!r} is {type(record[name]).__name__}, not text"
    return None


class FineTuning:
    """"sft": prompt/response examples, padded (or packed) to their micro-batch, trained on the response."""

    name = "sft"
    example_noun = "examples"
    dry_run_file = "check_clean.jsonl"

    def __init__(self, config) -> None:
        self.fetch = batch_fetcher(config.packing, config.max_length)
        self.loss = token_loss_sum
        self.count = trained_token_count
        self.validation = TokenValidation()

    def load_data(self, config, tokenizer, log, world_size: int) -> Data:
        records = load_records(config.dataset_path, config.revision)
        fingerprint = records_fingerprint(records)
        (train, val), (train_stats, val_stats) = cached_splits(config, tokenizer, fingerprint,
                                                               lambda: load_data(config, tokenizer, records), log)
        return Data(train, val, train_stats, val_stats, fingerprint)

    def build_model(self, config, tokenizer):
        return pretrained_model(config)

    def before_training(self, model, data: Data, backend, pad_id: int, log) -> None:
        """Nothing: the loss needs only the model being trained."""

    def sampler(self, config, data: Data, world_size: int, rank: int) -> StepSampler:
        return StepSampler(len(data.train), config.batch_size, world_size, rank, config.gradient_accumulation_steps,
                           config.seed, lengths=data.train["length"] if config.group_by_length else None)

    def window_metrics(self, backend) -> dict[str, float]:
        return {}

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        return epochs_line(sampler, total_steps, num_epochs)

    def plan_counts(self, config, data: Data, sampler, total_steps: int) -> DataPlan:
        train = data.train
        lengths = np.asarray(train["length"], dtype=np.int64)
        n_trained = np.asarray(train["n_trained"], dtype=np.int64)
        return DataPlan(train_examples=len(train), val_examples=len(data.val), epoch_tokens=int(lengths.sum()),
                        epoch_trained=int(n_trained.sum()), examples_per_step=sampler.examples_per_step,
                        steps_per_epoch=sampler.steps_per_epoch,
                        dropped_per_epoch=len(train) - sampler.steps_per_epoch * sampler.examples_per_step,
                        total_steps=total_steps,
                        run=count_run_tokens(run_layout(sampler, total_steps), lengths, n_trained, config.max_length))

    def scan_records(self, config, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has a prompt and a response, or a list of messages; the first `sample_size` that training
        keeps (a response, or a well-formed conversation) are the sample."""
        sample, count, shapes = [], 0, set()
        for where, record in finetune_records(config.dataset_path):
            if "messages" in record:
                if not isinstance(record["messages"], list):
                    raise UserError(f"{where}: field 'messages' is {type(record['messages']).__name__}, not a list "
                                    f"of messages")
                shapes.add("messages")
                usable = conversation_problem(record["messages"]) is None
                kept = {"messages": record["messages"], "source": "check"}
            else:
                problem = record_problem(record, FINETUNE_FIELDS)
                if problem:
                    raise UserError(f"{where}: {problem}")
                shapes.add(", ".join(FINETUNE_FIELDS))
                usable = bool(record["response"])
                kept = {"prompt": record["prompt"], "response": record["response"], "source": "check"}
            count += 1
            if len(sample) < sample_size and usable:
                sample.append(kept)
        return RecordScan(count, sample, sample_size, " or ".join(sorted(shapes)))

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{len(sample)} examples"


class CausalLM:
    """"causal_lm": raw text cut into rows of max_length, every position trained but each row's first; optionally
    built from a config (init: from_config) and with a z-loss."""

    name = "causal_lm"
    example_noun = "rows"
    dry_run_file = "check.jsonl"

    def __init__(self, config) -> None:
        self.fetch = fetch_rows
        self.loss = CausalLMLoss(config.z_loss)
        self.count = trained_token_count
        self.validation = TokenValidation()

    def load_data(self, config, tokenizer, log, world_size: int) -> Data:
        (train, val), (train_stats, val_stats) = load_pretrain_data(config, tokenizer, log, world_size=world_size)
        return Data(train, val, train_stats, val_stats, None if train.streaming else train.fingerprint())

    def build_model(self, config, tokenizer):
        if config.init == "from_config":
            return build_model_from_config(config, tokenizer)  # random weights, seeded by the caller
        return pretrained_model(config)

    def before_training(self, model, data: Data, backend, pad_id: int, log) -> None:
        """Nothing: the loss needs only the model being trained."""

    def sampler(self, config, data: Data, world_size: int, rank: int) -> StepSampler:
        return row_sampler(data.train, config.batch_size, world_size, rank, config.gradient_accumulation_steps,
                           config.seed, config.max_steps)

    def window_metrics(self, backend) -> dict[str, float]:
        return self.loss.window_metrics(backend)  # train/last_loss, train/z_loss (a collective)

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        if sampler.store.streaming:  # a stream's passes are unknown until each one ends
            return (f"{total_steps} optimiser steps (max_steps) over the stream, passing over it as often as that "
                    f"takes (global batch {sampler.examples_per_step} rows)")
        return epochs_line(sampler, total_steps, num_epochs)

    def plan_counts(self, config, data: Data, sampler, total_steps: int) -> DataPlan:
        """Rows are all max_length long and trained but their first position. A stream is read through once to
        count a pass's rows (training does not: it runs max_steps)."""
        store, stats = data.train, data.train_stats
        if store.streaming:
            stats = store.read_pass()
        rows = total_steps * sampler.examples_per_step
        tokens = rows * config.max_length
        trained = rows * (config.max_length - 1)
        return DataPlan(train_examples=stats.rows, val_examples=len(data.val),
                        epoch_tokens=stats.rows * config.max_length, epoch_trained=stats.rows * (config.max_length - 1),
                        examples_per_step=sampler.examples_per_step, steps_per_epoch=stats.steps,
                        dropped_per_epoch=stats.dropped_rows, total_steps=total_steps,
                        run=TokenCounts(examples=rows, tokens=tokens, trained=trained, padded=tokens, packed=tokens,
                                        packed_sampled=rows // config.batch_size, packed_real=tokens),
                        notes=[f"causal_lm: examples are rows of {config.max_length} tokens, all trained but the "
                               f"first"])

    def scan_records(self, config, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has text; the first records with text_factor x max_length characters are the sample (two
        rows or more). A stream is read up to `stream_limit` records: it may be larger than any check should read."""
        sample, count, chars = [], 0, 0
        for where, record in iter_records(config.dataset_path, config.revision):
            text = record_text(where, record, config.text_field)
            count += 1
            if chars < text_factor * config.max_length and text:
                sample.append({"text": text})
                chars += len(text)
            if config.streaming and count == stream_limit:
                break
        fields = config.text_field or "text/content"
        if config.streaming and count == stream_limit:
            fields += f" (the first {count:,} of the stream checked)"
        return RecordScan(count, sample, 1, fields)

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{summary['train_examples']} rows"  # the sample's text, cut into rows


class DirectPreference:
    """"dpo": prompt/chosen/rejected pairs, each micro-batch B pairs (2B sequences); the loss is DPO's, IPO's or
    SimPO's per pair, and the step's loss their mean over its pairs."""

    name = "dpo"
    example_noun = "pairs"
    dry_run_file = "check_clean.jsonl"

    def __init__(self, config) -> None:
        self.config = config
        self.fetch = fetch_pairs
        self.count = pair_count
        self.reference = reference_kind(config)
        self.loss = PreferenceLoss(PreferenceSettings.of(config), REFERENCES.get(self.reference))
        self.validation = PairValidation(self.loss)
        self.entry = None  # the tokenized data's cache entry: a precomputed reference is kept in it

    def load_data(self, config, tokenizer, log, world_size: int) -> Data:
        records = load_preference_records(config.dataset_path, config.revision)
        fingerprint = records_fingerprint(records, PAIR_FIELDS)
        self.entry = cache_entry(config, tokenizer, fingerprint)
        (train, val), (train_stats, val_stats) = cached_splits(
            config, tokenizer, fingerprint, lambda: load_pair_data(config, tokenizer, records), log)
        return Data(train, val, train_stats, val_stats, fingerprint)

    def build_model(self, config, tokenizer):
        model = pretrained_model(config)
        disable_dropout(model)
        return model

    def before_training(self, model, data: Data, backend, pad_id: int, log) -> None:
        if self.reference == "precomputed":
            attach_reference(data, model, backend, self.config, pad_id, self.entry, log)
        elif self.reference == "frozen_copy":
            self.loss.reference = frozen_copy(model, backend)

    def sampler(self, config, data: Data, world_size: int, rank: int) -> StepSampler:
        return StepSampler(len(data.train), config.batch_size, world_size, rank, config.gradient_accumulation_steps,
                           config.seed, lengths=data.train["length"] if config.group_by_length else None)

    def window_metrics(self, backend) -> dict[str, float]:
        return self.loss.window_metrics(backend)  # rewards/*, logps/* (a collective)

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        return epochs_line(sampler, total_steps, num_epochs, "pairs")

    def plan_counts(self, config, data: Data, sampler, total_steps: int) -> DataPlan:
        """A pair's tokens are both answers'; a micro-batch of B pairs is 2B rows padded to its longest answer."""
        train = data.train
        lengths = np.asarray(train["length"], dtype=np.int64)
        n_trained = np.asarray(train["n_trained"], dtype=np.int64)
        longest = np.asarray([max(len(c), len(r)) for c, r in zip(train["chosen_input_ids"],
                                                                 train["rejected_input_ids"])], dtype=np.int64)
        micro = run_layout(sampler, total_steps).reshape(-1, sampler.batch_size)
        tokens = int(lengths[micro].sum())
        padded = int(2 * micro.shape[1] * longest[micro].max(axis=1).sum()) if micro.size else 0
        return DataPlan(train_examples=len(train), val_examples=len(data.val), epoch_tokens=int(lengths.sum()),
                        epoch_trained=int(n_trained.sum()), examples_per_step=sampler.examples_per_step,
                        steps_per_epoch=sampler.steps_per_epoch,
                        dropped_per_epoch=len(train) - sampler.steps_per_epoch * sampler.examples_per_step,
                        total_steps=total_steps,
                        run=TokenCounts(examples=int(micro.size), tokens=tokens, trained=int(n_trained[micro].sum()),
                                        padded=padded, packed=padded, packed_sampled=len(micro), packed_real=tokens),
                        notes=["dpo: examples are pairs, each two sequences (prompt + chosen, prompt + rejected); "
                               "pairs are never packed", self.reference_note(len(train), len(data.val))],
                        reference_copies=int(self.reference == "frozen_copy"), rows_per_example=2)

    def reference_note(self, n_train: int, n_val: int) -> str:
        if self.reference is None:
            return "dpo reference: none (simpo is reference-free)"
        if self.reference == "adapter":
            return ("dpo reference: the base model with the LoRA adapter disabled: no memory beyond the model, one "
                    "more no-grad forward per micro-batch")
        if self.reference == "frozen_copy":
            return ("dpo reference: frozen_copy: a second fp32 copy of the weights in every process (the 'reference' "
                    "memory above) and one more no-grad forward per micro-batch; not under ZeRO-3 or FSDP2")
        return (f"dpo reference: precomputed (the default): before step 1, one no-grad pass of the initial weights "
                f"over the {n_train:,} train and {n_val:,} validation pairs, cached with the tokenized data; "
                f"training then holds no reference model (reference: frozen_copy would hold a second fp32 copy of "
                f"the weights, 4 bytes per parameter, in every process)")

    def scan_records(self, config, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has a prompt, a chosen and a rejected answer, all text or all messages; the first
        `sample_size` pairs training keeps are the sample."""
        sample, count, shapes = [], 0, set()
        for _, row in preference_rows(config.dataset_path, config.revision):
            count += 1
            shapes.add("messages" if isinstance(row["chosen"], list) else "text")
            if len(sample) < sample_size and pair_problem(*(row[name] for name in PAIR_FIELDS)) is None:
                sample.append({**row, "source": "check"})
        return RecordScan(count, sample, sample_size, f"{', '.join(PAIR_FIELDS)} ({' or '.join(sorted(shapes))})")

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{len(sample)} pairs"


OBJECTIVES: dict[str, Callable[[Any], Objective]] = {"sft": FineTuning, "causal_lm": CausalLM,
                                                     "dpo": DirectPreference}


def objective_for(config) -> Objective:
    """The objective `config.objective` names, built for this config."""
    return OBJECTIVES[config.objective](config)
