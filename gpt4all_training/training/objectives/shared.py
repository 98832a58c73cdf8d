"""What more than one objective builds the same way: the members of an objective whose batches come from its data
alone, the sampler over tokenized examples, the line about the run's length, the plan of a split of examples, and
the frozen copy of the initial weights that a reference can be."""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import torch

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.errors import UserError
from gpt4all_training.training.counts import DataPlan, TokenCounts
from gpt4all_training.training.loss import sequence_logps
from gpt4all_training.training.objectives.protocol import Batch, Data


class BatchesFromData:
    """The members an objective takes as they are when each step's batches come from its data alone (sft,
    causal_lm, dpo): each micro-batch is `fetch`ed from the dataset, nothing is kept between steps, nothing is done
    before step 1 and there are no metrics of its own. An objective defines its own where it does more."""

    fetch: Callable[[Any, list[int], int], Batch]  # a micro-batch of the dataset: (dataset, indices, pad_id)

    def before_training(self, model, data: Data, backend, pad_id: int, log: Callable[[str], Any]) -> None:
        """Nothing: the loss needs only the model being trained."""

    def step_batches(self, model, backend, dataset, step: int, indices: list[list[int]], pad_id: int) -> list[Batch]:
        return [self.fetch(dataset, micro, pad_id) for micro in indices]

    def window_metrics(self, backend) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to take back."""


def example_sampler(config: TrainConfig, data: Data, world_size: int, rank: int) -> StepSampler:
    """The sampler over a tokenized split of examples (sft's examples, dpo's pairs), grouped by their `length`
    column when group_by_length."""
    return StepSampler(len(data.train), config.batch_size, world_size, rank, config.gradient_accumulation_steps,
                       config.seed, lengths=data.train["length"] if config.group_by_length else None)


def epochs_line(sampler, total_steps: int, num_epochs: int, noun: str) -> str:
    return (f"{total_steps} optimiser steps: {sampler.steps_per_epoch} per epoch x {num_epochs} epochs "
            f"(global batch {sampler.examples_per_step} {noun})")


def example_plan(data: Data, sampler: StepSampler, total_steps: int, run: TokenCounts,
                 notes: tuple[str, ...] = ()) -> DataPlan:
    """The plan of a run over a tokenized split of examples, each with its `length` and `n_trained` tokens; `run`
    counts the micro-batches this run takes."""
    train = data.train
    return DataPlan(train_examples=len(train), val_examples=len(data.val),
                    epoch_tokens=int(np.asarray(train["length"], dtype=np.int64).sum()),
                    epoch_trained=int(np.asarray(train["n_trained"], dtype=np.int64).sum()),
                    examples_per_step=sampler.examples_per_step, steps_per_epoch=sampler.steps_per_epoch,
                    dropped_per_epoch=len(train) - sampler.steps_per_epoch * sampler.examples_per_step,
                    total_steps=total_steps, run=run, notes=list(notes))


class FrozenCopy:
    """A frozen copy of the initial weights, scoring each micro-batch without gradient."""

    def __init__(self, model) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logps(self.model, batch)


def frozen_copy(model, backend) -> FrozenCopy:
    """reference: frozen_copy, from the prepared model (still the initial weights)."""
    if backend.partitions_parameters:
        raise UserError("reference: frozen_copy needs the whole model in every process, which ZeRO-3 and FSDP2 "
                        "partition; use reference: precomputed")
    return FrozenCopy(backend.unwrap(model))


def peft_model(model):
    """The PEFT model inside the DDP, DeepSpeed or compile wrappers."""
    while not hasattr(model, "disable_adapter"):
        model = getattr(model, "module", None) or model._orig_mod
    return model
