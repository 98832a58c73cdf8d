"""The order of examples: a function of (seed, epoch) alone, identical for every world size.

An optimiser step consumes `batch_size * world_size * grad_accum` consecutive examples of the epoch's permutation.
Micro-batch j of that step is the j-th slice of `batch_size * world_size`; rank r takes the r-th `batch_size` of
it. So global step s covers the same examples on 1, 2 or 8 ranks, and the position in an epoch is one integer:
the step. Resuming starts at that step without reading the data before it. The last partial step of an epoch is
dropped in every world size (never padded with repeated examples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class StepSampler:
    n_examples: int
    batch_size: int
    world_size: int = 1
    rank: int = 0
    grad_accum: int = 1
    seed: int = 0

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        steps = self.n_examples // self.examples_per_step
        if steps == 0:
            raise UserError(f"batch_size: one optimiser step needs {self.examples_per_step} examples "
                            f"(batch_size x processes x gradient_accumulation_steps) but the training split has "
                            f"{self.n_examples}; lower batch_size or gradient_accumulation_steps")
        return steps

    def epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_examples, generator=generator)

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (lists of example indices) for global optimiser step `step`."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        start = position * self.examples_per_step
        micro = self.batch_size * self.world_size
        batches = []
        for j in range(self.grad_accum):
            offset = start + j * micro + self.rank * self.batch_size
            batches.append(order[offset:offset + self.batch_size].tolist())
        return batches
