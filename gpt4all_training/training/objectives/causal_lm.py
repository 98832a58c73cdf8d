""""causal_lm": raw text joined with EOS and cut into rows of max_length, every token trained (data/text.py);
optionally a model built from a config (init: from_config) and a z-loss."""

from __future__ import annotations

from typing import Any


from gpt4all_training.batch import trained_token_count
from gpt4all_training.config.blocks import Objective
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.batching import fetch_rows
from gpt4all_training.data.records import iter_records, record_text
from gpt4all_training.data.sampling import StepSampler, row_sampler
from gpt4all_training.data.text import load_pretrain_data
from gpt4all_training.model.build import build_training_model
from gpt4all_training.training.counts import DataPlan, TokenCounts
from gpt4all_training.training.evaluate import TokenValidation
from gpt4all_training.training.loss import CausalLMLoss
from gpt4all_training.training.objectives.protocol import Data, RecordScan
from gpt4all_training.training.objectives.shared import BatchesFromData, epochs_line


class CausalLM(BatchesFromData):
    """"causal_lm": raw text cut into rows of max_length, every position trained but each row's first."""

    name = "causal_lm"
    prepares_once = False
    dry_run_file = "check.jsonl"
    rows_per_example = 1
    reference_copies = 0
    shows_examples = False

    def __init__(self, config: Objective) -> None:
        self.fetch = fetch_rows
        self.loss = CausalLMLoss(config.z_loss)
        self.count = trained_token_count
        self.validation = TokenValidation()

    def load_data(self, config: TrainConfig, tokenizer, log, world_size: int) -> Data:
        (train, val), (train_stats, val_stats) = load_pretrain_data(config, tokenizer, log, world_size=world_size)
        return Data(train, val, train_stats, val_stats, None if train.streaming else train.fingerprint())

    def build_model(self, config: TrainConfig, tokenizer, backend):
        return build_training_model(config, tokenizer, backend)  # init from_config: random, seeded by the caller

    def sampler(self, config: TrainConfig, data: Data, world_size: int, rank: int) -> StepSampler:
        return row_sampler(data.train, config.batch_size, world_size, rank, config.gradient_accumulation_steps,
                           config.seed, config.max_steps)

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        if sampler.store.streaming:  # a stream's passes are unknown until each one ends
            return (f"{total_steps} optimiser steps (max_steps) over the stream, passing over it as often as that "
                    f"takes (global batch {sampler.examples_per_step} rows)")
        return epochs_line(sampler, total_steps, num_epochs, "rows")

    def window_metrics(self, backend) -> dict[str, float]:
        return self.loss.window_metrics(backend)  # train/last_loss, train/z_loss (a collective)

    def plan_counts(self, config: TrainConfig, data: Data, sampler, total_steps: int) -> DataPlan:
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

    def scan_records(self, config: TrainConfig, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has text; the first records with text_factor x max_length characters are the sample (two
        rows or more). A stream is read up to `stream_limit` records: it may be larger than any check should read."""
        assert config.dataset_path is not None  # validate() refuses a config without it
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
