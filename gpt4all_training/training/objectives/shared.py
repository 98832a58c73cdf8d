"""What more than one objective builds the same way: the sampler over tokenized examples, the line about the run's
length, and the plan of a split of examples."""

from __future__ import annotations

import numpy as np

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.data.sampling import StepSampler
from gpt4all_training.training.counts import DataPlan, TokenCounts
from gpt4all_training.training.objectives.protocol import Data


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
