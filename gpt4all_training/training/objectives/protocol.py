"""The two faces of an objective: what the training loop asks of it (`TrainingObjective`) and what `plan` and `check`
ask of it (`ObjectiveChecks`). Each objective is one class, in a module of its own, with both faces;
`objective_for(config)` builds it (`Objective`: both at once). The loop sees only the first, so an objective's
checks can grow without touching it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.training.counts import DataPlan
from gpt4all_training.training.evaluate import Validation

Batch = dict[str, torch.Tensor]


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
    of them), which fields were read, and whether some are conversations (their chat template is then checked)."""
    count: int
    sample: list[dict[str, Any]]
    min_sample: int
    fields: str
    conversations: bool = False


@runtime_checkable
class TrainingObjective(Protocol):
    """What train() asks of an objective, in the order it asks. (The callables are read-only properties here so that
    an objective may hold any callable of that shape, a function or an object, as a plain attribute.)"""
    name: str
    # load_data prepares under data/cache.py's file lock: one process per cache entry tokenizes while the others
    # wait on the lock (no collective, so no timeout), then read its entry. False: train() lets the main process
    # load first (filling datasets' caches) while the others wait in a collective.
    prepares_once: bool

    @property
    def loss(self) -> Callable[[Any, Batch], torch.Tensor]:
        """A micro-batch's loss, summed over what `count` counts."""
        ...

    @property
    def count(self) -> Callable[[Batch], int]:
        """What the loss sums over (trained tokens, pairs): the step divides by its total."""
        ...

    @property
    def validation(self) -> Validation:
        """What validation measures."""
        ...

    def load_data(self, config: TrainConfig, tokenizer, log: Callable[[str], Any], world_size: int) -> Data: ...

    def build_model(self, config: TrainConfig, tokenizer, backend) -> torch.nn.Module:
        """The model the run trains, assembled by model/build.py (its base, adapter, checkpointing, counts)."""
        ...

    def sampler(self, config: TrainConfig, data: Data, world_size: int, rank: int):
        """Which examples each rank takes at each step (data/sampling.py's StepSampler)."""
        ...

    def before_training(self, model, data: Data, backend, pad_id: int, log: Callable[[str], Any]) -> None:
        """Work on the prepared model before step 1, while it holds the initial weights (a resume loads its
        checkpoint afterwards): dpo's reference. It may add columns to `data`'s splits."""
        ...

    def steps_line(self, sampler, total_steps: int, num_epochs: int) -> str:
        """The line the loop prints about the run's length."""
        ...

    def step_batches(self, model, backend, dataset, step: int, indices: list[list[int]], pad_id: int) -> list[Batch]:
        """This rank's micro-batches of optimizer step `step` (0-based), one per list of `indices` (the sampler's
        step_indices(step)). The loop calls it once per step, just before the update, with the model being
        trained (prepared by `backend`, in train mode) holding the weights that update starts from: an objective
        that samples from the policy generates here; the others read `dataset` alone. The loop times this call
        apart from the update (the meter's batch_seconds and update_seconds)."""
        ...

    def window_metrics(self, backend) -> dict[str, float]:
        """The objective's own metrics since the last call, for the training row (a collective: every rank calls
        it)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What this rank's next step needs that the weights, the optimizer and the step do not give back, for the
        checkpoint (objective/rank{r}.pt): grpo's sampled rows between two steps that train on them. Empty for an
        objective that builds each step's batches from the data alone."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take back what state_dict gave, when a run resumes from the checkpoint."""
        ...


@runtime_checkable
class ObjectiveChecks(Protocol):
    """What `plan` and `check` (and `data`) ask of an objective besides its data and sampler."""
    name: str
    dry_run_file: str  # the name `check` gives its sample, so that the data loader reads it as this objective's
    rows_per_example: int  # sequences a micro-batch holds per example (a dpo pair: 2), for the memory estimate
    reference_copies: int  # frozen copies of the weights kept besides the trained model, for the memory estimate
    shows_examples: bool  # `data` can show and dump its examples (data/sft.py's prompt/response or conversations)

    def plan_counts(self, config: TrainConfig, data: Data, sampler, total_steps: int) -> DataPlan: ...

    def scan_records(self, config: TrainConfig, sample_size: int, text_factor: int,
                     stream_limit: int) -> RecordScan: ...

    def dry_run_size(self, summary: dict[str, Any], sample: list[dict[str, Any]]) -> str:
        """What the dry run trained on, for its line ("2 examples")."""
        ...


class Objective(TrainingObjective, ObjectiveChecks, Protocol):
    """Both faces: what objective_for returns."""
