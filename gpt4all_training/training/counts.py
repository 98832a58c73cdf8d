"""What a run trains, counted before it runs: the micro-batches of every step, their tokens, padding and packing.

`plan` prints these; the objectives (training/objectives/) compute them with the sampler the loop uses, so the
planned steps, examples and trained tokens are the ones training then takes, for any number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gpt4all_training.data.batching import pack_rows

# Packing is simulated micro-batch by micro-batch (first-fit decreasing in Python); beyond this many, a prefix.
PACKING_SAMPLE = 50_000


def run_layout(sampler, total_steps: int) -> np.ndarray:
    """Example indices of every micro-batch of the run: shape (steps, accumulation, ranks, batch_size).

    The reshape is the sampler's rule (micro-batch j of a step is its j-th slice of batch x ranks; rank r takes
    the r-th batch of it), applied to `sampler.epoch_order`, so it is `step_indices` for every rank at once.
    """
    pieces, step = [], 0
    while step < total_steps:
        epoch, position = divmod(step, sampler.steps_per_epoch)
        steps_here = min(sampler.steps_per_epoch - position, total_steps - step)
        order = sampler.epoch_order(epoch).numpy()
        start = position * sampler.examples_per_step
        pieces.append(order[start:start + steps_here * sampler.examples_per_step])
        step += steps_here
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return flat.reshape(total_steps, sampler.grad_accum, sampler.world_size, sampler.batch_size)


@dataclass
class TokenCounts:
    examples: int
    tokens: int  # real tokens: what tokens_per_s counts
    trained: int  # tokens with a loss: what train.py's trained_tokens counts
    padded: int  # micro-batches padded to their longest example
    packed: Optional[int] = None  # the same micro-batches packed into rows of up to max_length
    packed_sampled: int = 0  # micro-batches the packed figure was measured on (all, or a prefix)
    packed_real: int = 0  # real tokens of those micro-batches


def count_run_tokens(layout: np.ndarray, lengths: np.ndarray, n_trained: np.ndarray, max_length: int,
                     packing_sample: int = PACKING_SAMPLE) -> TokenCounts:
    micro = layout.reshape(-1, layout.shape[-1])
    micro_lengths = lengths[micro]
    counts = TokenCounts(examples=int(micro.size), tokens=int(micro_lengths.sum()), trained=int(n_trained[micro].sum()),
                         padded=int((micro_lengths.max(axis=1) * micro_lengths.shape[1]).sum()) if micro.size else 0)
    sample = micro_lengths[:packing_sample]
    packed = 0
    for row_lengths in sample.tolist():
        rows = pack_rows(row_lengths, max_length)
        packed += len(rows) * max(sum(row_lengths[i] for i in row) for row in rows)
    counts.packed, counts.packed_sampled, counts.packed_real = packed, len(sample), int(sample.sum())
    return counts


@dataclass
class DataPlan:
    train_examples: int  # examples, or rows per pass for causal_lm
    val_examples: int
    epoch_tokens: int
    epoch_trained: int
    examples_per_step: int
    steps_per_epoch: int
    dropped_per_epoch: int
    total_steps: int
    run: TokenCounts
    notes: list[str] = field(default_factory=list)  # what the plan should say about this objective
