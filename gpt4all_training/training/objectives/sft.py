""""sft": prompt/response records, the loss on the response (data/sft.py); or conversations (records with
`messages`, detected from the data), the loss on the assistant turns (data/chat.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpt4all_training.batch import trained_token_count
from gpt4all_training.config.blocks import DataSource, Examples
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.batching import batch_fetcher
from gpt4all_training.data.cache import cached_splits
from gpt4all_training.data.conversations import conversation_problem
from gpt4all_training.data.records import finetune_records, load_records, records_fingerprint
from gpt4all_training.data.sft import load_data
from gpt4all_training.errors import UserError
from gpt4all_training.model.attention import attends_per_example
from gpt4all_training.model.build import build_training_model
from gpt4all_training.training.counts import DataPlan, count_run_tokens, run_layout
from gpt4all_training.training.evaluate import TokenValidation
from gpt4all_training.training.loss import token_loss_sum
from gpt4all_training.training.objectives.protocol import Data, RecordScan
from gpt4all_training.training.objectives.shared import BatchesFromData, epochs_line, example_plan, example_sampler

# Prompt/response fields every fine-tuning record needs.
FINETUNE_FIELDS = ("prompt", "response")


def record_problem(record: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    for name in fields:
        if name not in record:
            present = ", ".join(map(str, record)) or "none"
            return f"no {name!r} field (fields: {present}); run clean.py on the raw data first"
        if not isinstance(record[name], str):
            return f"field {name!r} is {type(record[name]).__name__}, not text"
    return None


class FineTuning(BatchesFromData):
    """"sft": prompt/response examples, padded (or packed) to their micro-batch, trained on the response."""

    name = "sft"
    prepares_once = True
    dry_run_file = "check_clean.jsonl"
    rows_per_example = 1
    reference_copies = 0
    shows_examples = True
    sampler = staticmethod(example_sampler)

    def __init__(self, config: TrainConfig) -> None:
        self.loss = token_loss_sum
        self.count = trained_token_count
        self.validation = TokenValidation()

    def load_data(self, config: TrainConfig, tokenizer, log, world_size: int) -> Data:
        assert config.dataset_path is not None  # validate() refuses a config without it
        records = load_records(config.dataset_path, config.revision)
        fingerprint = records_fingerprint(records)
        (train, val), (train_stats, val_stats) = cached_splits(config, tokenizer, fingerprint,
                                                               lambda: load_data(config, tokenizer, records), log)
        return Data(train, val, train_stats, val_stats, fingerprint)

    def build_model(self, config: TrainConfig, tokenizer, backend):
        model = build_training_model(config, tokenizer, backend)
        self.fetch = batch_fetcher(config.packing, config.max_length, one_row=attends_per_example(model))
        return model

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        return epochs_line(sampler, total_steps, num_epochs, "examples")

    def plan_counts(self, config: Examples, data: Data, sampler, total_steps: int) -> DataPlan:
        lengths = np.asarray(data.train["length"], dtype=np.int64)
        n_trained = np.asarray(data.train["n_trained"], dtype=np.int64)
        run = count_run_tokens(run_layout(sampler, total_steps), lengths, n_trained, config.max_length)
        return example_plan(data, sampler, total_steps, run)

    def scan_records(self, config: DataSource, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has a prompt and a response, or a list of messages; the first `sample_size` that training
        keeps (a response, or a well-formed conversation) are the sample."""
        assert config.dataset_path is not None  # validate() refuses a config without it
        sample: list[dict[str, Any]] = []
        count, shapes = 0, set()
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
        return RecordScan(count, sample, sample_size, " or ".join(sorted(shapes)), conversations="messages" in shapes)

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{len(sample)} examples"
