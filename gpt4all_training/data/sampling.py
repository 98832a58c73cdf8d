"""The order of examples: a function of (seed, epoch) alone, identical for every world size.

An optimiser step consumes `batch_size * world_size * grad_accum` consecutive examples of the epoch's permutation.
Micro-batch j of that step is the j-th slice of `batch_size * world_size`; rank r takes the r-th `batch_size` of
it. So global step s covers the same examples on 1, 2 or 8 ranks, and the position in an epoch is one integer:
the step. Resuming starts at that step without reading the data before it. The last partial step of an epoch is
dropped in every world size (never padded with repeated examples).

With `lengths` given (group_by_length), each epoch's permutation is regrouped: it is cut into groups of
`GROUP_STEPS` optimiser steps, each group is sorted by length (longest first) and cut into steps again, and the
steps of a group are shuffled. A step, and each micro-batch in it, then holds examples of similar length and pads
little. The order is still a function of (seed, epoch) alone, every example still comes once per epoch, epochs
still differ, and a step's examples are the same for every world size with the same global batch.

Raw-text rows (`store`, a row store of data/text.py) are sliced the same way, from the run's sequence of global row
ids: step s trains rows s*G .. s*G+G-1, and the store maps each id to its pass and its place in that pass's shuffled
order (a stream's passes have no length known in advance, so the step cannot be divided into epoch and position
here). A stream's position is then state of its own (`data_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from gpt4all_training.errors import UserError

# Steps whose examples are sorted by length together: larger groups give more even batches, smaller keep more shuffle.
GROUP_STEPS = 16


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's order, for examples (torch) and raw-text rows (random) alike."""
    return seed * 1_000_003 + epoch


@dataclass(frozen=True)
class StepSampler:
    n_examples: int
    batch_size: int
    world_size: int = 1
    rank: int = 0
    grad_accum: int = 1
    seed: int = 0
    lengths: Optional[Sequence[int]] = field(default=None, compare=False, repr=False)
    store: Any = field(default=None, compare=False, repr=False)  # a raw-text row store, which orders its rows itself
    max_steps: Optional[int] = None  # the run's length, which a stream of rows needs
    _orders: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.lengths is not None:
            if len(self.lengths) != self.n_examples:
                raise ValueError(f"{len(self.lengths)} lengths for {self.n_examples} examples")
            object.__setattr__(self, "lengths", torch.as_tensor(list(self.lengths), dtype=torch.long))
        if self.store is not None and self.store.configure(self.examples_per_step) is None and not self.max_steps:
            raise UserError("max_steps: streaming: true with objective causal_lm needs max_steps (a stream's length "
                            "is unknown until it ends)")

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch. A stream's passes are unknown in advance: there, the run (max_steps) counts as one."""
        if self.store is not None and self.store.streaming:
            assert self.max_steps is not None  # __post_init__ refused a stream without it
            return self.max_steps
        if self.store is not None:
            return self.store.stats.steps
        steps = self.n_examples // self.examples_per_step
        if steps == 0:
            raise UserError(f"batch_size: one optimiser step needs {self.examples_per_step} examples "
                            f"(batch_size x processes x gradient_accumulation_steps) but the training split has "
                            f"{self.n_examples}; lower batch_size or gradient_accumulation_steps")
        return steps

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch in self._orders:
            return self._orders[epoch]
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.n_examples, generator=generator)
        if self.lengths is not None:
            order = group_by_length(order, torch.as_tensor(self.lengths), self.examples_per_step, self.steps_per_epoch,
                                    generator)
        self._orders.clear()  # one epoch at a time is all the loop asks for
        self._orders[epoch] = order
        return order

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (lists of example indices, or global row ids) for global optimizer step `step`."""
        if self.store is not None:
            order, start = None, step * self.examples_per_step
        else:
            epoch, position = divmod(step, self.steps_per_epoch)
            order, start = self.epoch_order(epoch), position * self.examples_per_step
        micro = self.batch_size * self.world_size
        batches = []
        for j in range(self.grad_accum):
            offset = start + j * micro + self.rank * self.batch_size
            batches.append(list(range(offset, offset + self.batch_size)) if order is None
                           else order[offset:offset + self.batch_size].tolist())
        return batches

    def data_state(self) -> Optional[dict[str, Any]]:
        """A stream's position, which the step alone cannot give back without reading the stream again; otherwise
        nothing beyond the step: an epoch's order is a function of (seed, epoch)."""
        return self.store.state_dict() if self.store is not None and self.store.streaming else None

    def load_data_state(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state)


def row_sampler(store, batch_size: int, world_size: int = 1, rank: int = 0, grad_accum: int = 1, seed: int = 0,
                max_steps: Optional[int] = None) -> StepSampler:
    """The sampler over a raw-text row store. Its n_examples are the rows per pass when the store knows them up
    front, 0 for a stream (the same before and after a resume). Rows are never grouped by length."""
    return StepSampler(0 if store.streaming else len(store), batch_size, world_size, rank, grad_accum, seed,
                       store=store, max_steps=max_steps)


def group_by_length(order: torch.Tensor, lengths: torch.Tensor, examples_per_step: int, steps: int,
                    generator: torch.Generator, group_steps: int = GROUP_STEPS) -> torch.Tensor:
    """`order` regrouped so that each step holds examples of similar length (see the module docstring).

    Only the examples of the epoch's full steps are regrouped; the dropped tail stays the permutation's tail.
    """
    used = steps * examples_per_step
    pieces = []
    for start in range(0, used, group_steps * examples_per_step):
        group = order[start:min(start + group_steps * examples_per_step, used)]
        group = group[torch.sort(lengths[group], descending=True, stable=True).indices]
        group_steps_here = group.numel() // examples_per_step
        shuffled = torch.randperm(group_steps_here, generator=generator)
        pieces.append(group.view(group_steps_here, examples_per_step)[shuffled].reshape(-1))
    pieces.append(order[used:])
    return torch.cat(pieces)
