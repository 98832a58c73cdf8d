""""dpo": prompt/chosen/rejected pairs (data/pairs.py), DPO, IPO or SimPO over the answers' log-probabilities against
a reference (loss.py and reference.py beside this); the step's loss is a mean over pairs, not tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpt4all_training.config.blocks import DataSource
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.cache import cache_entry, cached_splits
from gpt4all_training.data.pairs import (fetch_pairs, load_pair_data, load_preference_records, pair_count,
                                         preference_rows)
from gpt4all_training.data.preferences import PAIR_FIELDS, pair_problem
from gpt4all_training.data.records import records_fingerprint
from gpt4all_training.model.build import build_training_model
from gpt4all_training.training.counts import DataPlan, TokenCounts, run_layout
from gpt4all_training.training.objectives.dpo.loss import PairValidation, PreferenceLoss, PreferenceSettings
from gpt4all_training.training.objectives.dpo.reference import REFERENCES, attach_reference, reference_kind
from gpt4all_training.training.objectives.protocol import Data, RecordScan
from gpt4all_training.training.objectives.shared import (BatchesFromData, epochs_line, example_plan, example_sampler,
                                                         frozen_copy)


class DirectPreference(BatchesFromData):
    """"dpo": prompt/chosen/rejected pairs, each micro-batch B pairs (2B sequences); the loss is DPO's, IPO's or
    SimPO's per pair, and the step's loss their mean over its pairs."""

    name = "dpo"
    prepares_once = True
    dry_run_file = "check_clean.jsonl"
    rows_per_example = 2  # prompt + chosen, prompt + rejected
    shows_examples = False
    sampler = staticmethod(example_sampler)

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.fetch = fetch_pairs
        self.count = pair_count
        self.reference = reference_kind(config)
        self.reference_copies = int(self.reference == "frozen_copy")
        self.loss = PreferenceLoss(PreferenceSettings.of(config),
                                   REFERENCES.get(self.reference) if self.reference is not None else None)
        self.validation = PairValidation(self.loss)
        self.entry: Path | None = None  # the tokenized data's cache entry: a precomputed reference is kept in it

    def load_data(self, config: TrainConfig, tokenizer, log, world_size: int) -> Data:
        assert config.dataset_path is not None  # validate() refuses a config without it
        records = load_preference_records(config.dataset_path, config.revision)
        fingerprint = records_fingerprint(records, PAIR_FIELDS)
        self.entry = cache_entry(config, tokenizer, fingerprint)
        (train, val), (train_stats, val_stats) = cached_splits(
            config, tokenizer, fingerprint, lambda: load_pair_data(config, tokenizer, records), log)
        return Data(train, val, train_stats, val_stats, fingerprint)

    def build_model(self, config: TrainConfig, tokenizer, backend):
        return build_training_model(config, tokenizer, backend, dropout_off=True)

    def before_training(self, model, data: Data, backend, pad_id: int, log) -> None:
        if self.reference == "precomputed":
            attach_reference(data, model, backend, self.config, pad_id, self.entry, log)
        elif self.reference == "frozen_copy":
            self.loss.reference = frozen_copy(model, backend)

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        return epochs_line(sampler, total_steps, num_epochs, "pairs")

    def window_metrics(self, backend) -> dict[str, float]:
        return self.loss.window_metrics(backend)  # rewards/*, logps/* (a collective)

    def plan_counts(self, config: TrainConfig, data: Data, sampler, total_steps: int) -> DataPlan:
        """A pair's tokens are both answers'; a micro-batch of B pairs is 2B rows padded to its longest answer."""
        train = data.train
        lengths = np.asarray(train["length"], dtype=np.int64)
        n_trained = np.asarray(train["n_trained"], dtype=np.int64)
        longest = np.asarray([max(len(c), len(r)) for c, r in zip(train["chosen_input_ids"],
                                                                 train["rejected_input_ids"])], dtype=np.int64)
        micro = run_layout(sampler, total_steps).reshape(-1, sampler.batch_size)
        tokens = int(lengths[micro].sum())
        padded = int(2 * micro.shape[1] * longest[micro].max(axis=1).sum()) if micro.size else 0
        run = TokenCounts(examples=int(micro.size), tokens=tokens, trained=int(n_trained[micro].sum()), padded=padded,
                          packed=padded, packed_sampled=len(micro), packed_real=tokens)
        return example_plan(data, sampler, total_steps, run,
                            ("dpo: examples are pairs, each two sequences (prompt + chosen, prompt + rejected); pairs "
                             "are never packed", self.reference_note(len(train), len(data.val))))

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

    def scan_records(self, config: DataSource, sample_size: int, text_factor: int, stream_limit: int) -> RecordScan:
        """Every record has a prompt, a chosen and a rejected answer, all text or all messages; the first
        `sample_size` pairs training keeps are the sample."""
        assert config.dataset_path is not None  # validate() refuses a config without it
        sample: list[dict[str, Any]] = []
        count, shapes = 0, set()
        for _, row in preference_rows(config.dataset_path, config.revision):
            count += 1
            shapes.add("messages" if isinstance(row["chosen"], list) else "text")
            if len(sample) < sample_size and pair_problem(*(row[name] for name in PAIR_FIELDS)) is None:
                sample.append({**row, "source": "check"})
        return RecordScan(count, sample, sample_size, f"{', '.join(PAIR_FIELDS)} ({' or '.join(sorted(shapes))})")

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        return f"{len(sample)} pairs"
