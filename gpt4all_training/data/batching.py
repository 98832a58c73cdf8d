"""Building micro-batches (the format of batch.py), one builder for every layout:
- padded: each example a row, padded on the right to the batch's longest (training, evaluation, inference);
- left-padded: prompts ending at the same column, for generation;
- constant-length rows: raw-text rows of max_length tokens, every token trained but the first;
- packed: whole examples in as few rows as possible, with no attention across examples; or, for a model that
  attends example by example (model/attention.py, on a CPU), in one row with nothing padded.

Packing: lay a micro-batch's examples out in as few rows as possible, with no attention across examples.

What packing changes, and what it does not. The sampler fixes which examples each optimiser step trains on, as a
function of (seed, epoch, step), for every world size. Packing only changes how one micro-batch's examples are laid
out in rows: whole examples go into bins of up to `max_length` tokens (none is split), instead of one padded row
each. The set of examples, their labels and the token-weighted loss of the step are unchanged, so a step with
packing equals a step without it (within float rounding), resume stays one integer, and distributed parity holds as
it does unpacked. Packing across micro-batches would pack tighter, but it would make a step's contents depend on the
packer, and the step count on the data's lengths.

The row layout. First-fit decreasing decides how many rows a micro-batch needs. The examples are then dealt again,
longest first, each onto the row with the fewest tokens so far (still never past `max_length`). Rows come out nearly
equal in length, and the batch is padded only to its longest row: pure first-fit decreasing would fill the first
rows to `max_length` and leave the last one short, which pads every row to `max_length`.

How attention is kept inside each example. A packed batch carries `position_ids` that restart at 0 for every example
(and for the padding at the end of a row), and no `attention_mask`. transformers 5 (masking_utils
`find_packed_sequence_indices`) reads a restart of the position ids as a sequence boundary whenever no 2-D mask is
given, and builds a block-diagonal causal mask for the attention implementation in use:
- sdpa and eager (CPU and GPU): a 4-D boolean or additive mask, block-diagonal and causal;
- flex attention: a block mask from the same rule;
- flash-attention 2/3 (GPU): varlen kernels with `cu_seqlens` taken from the position ids, so no padding or masked
  blocks are computed at all.
One batch format therefore works on CPU and GPU with GPT-J, Llama and the other models built on `create_causal_mask`.
On a CPU the micro-batch is instead one row with `cu_seq_lens_q` (where each example starts), and the model
attends example by example (model/attention.py): no padding, and no masked-out blocks computed.
A model with its own attention code may ignore position ids and attend across examples; model/isolation.py's
`check_isolation` runs at start-up and refuses such a model rather than train it on contaminated context.

Labels are the unpacked labels copied as they are. The first token of each example keeps its IGNORE label (nothing
in the example predicts it; the previous example's last token must not learn to predict it).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from gpt4all_training.batch import IGNORE


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of positions into `lengths`) of total length <= capacity: each item, longest first, into the
    first bin with room. Ties keep the input order, so the result is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"an example of {lengths[i]} tokens does not fit a row of {capacity}")
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_bins(lengths: list[int], n_bins: int, capacity: int) -> list[list[int]] | None:
    """Longest first onto the least-filled of `n_bins` bins; None if some item finds no bin with room."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = min(range(n_bins), key=lambda k: loads[k])
        if loads[b] + lengths[i] > capacity:
            return None
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def pack_rows(lengths: list[int], max_length: int) -> list[list[int]]:
    """The rows of a packed micro-batch: the fewest rows first-fit decreasing finds, with loads balanced when the
    balanced deal also fits, so that padding to the longest row wastes little. No example is split."""
    if not lengths:
        return []
    rows = first_fit_decreasing(lengths, max_length)
    balanced = balanced_bins(lengths, len(rows), max_length)
    if balanced is not None and max(sum(lengths[i] for i in b) for b in balanced) <= \
            max(sum(lengths[i] for i in r) for r in rows):
        rows = balanced
    return [sorted(row) for row in rows]  # the sampler's order inside a row: the layout is a pure function of it


def collate(examples: Sequence[dict[str, Any]], pad_id: int, padding_side: Literal["right", "left"] = "right"
            ) -> dict[str, torch.Tensor]:
    """A micro-batch of `examples` ({"input_ids", and "labels" unless they are prompts}).

    Padded to the longest example with `pad_id` (labels IGNORE, attention_mask 0), on the right, or on the `left`
    (prompts to generate from, which must end at the same column). Packed batches: collate_packed.
    """
    width = max(len(e["input_ids"]) for e in examples)
    shape = (len(examples), width)
    labelled = "labels" in examples[0]
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long) if labelled else None
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        columns = slice(0, n) if padding_side == "right" else slice(width - n, width)
        input_ids[i, columns] = torch.as_tensor(example["input_ids"])
        if labels is not None:
            labels[i, columns] = torch.as_tensor(example["labels"])
        attention_mask[i, columns] = 1
    if labels is None:
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def row_labels(row: Sequence[int]) -> list[int]:
    """A raw-text row's labels: every token trained but the first, which nothing predicts."""
    return [IGNORE, *row[1:]]


def collate_rows(rows: Sequence[Sequence[int]] | np.ndarray) -> dict[str, torch.Tensor]:
    """Constant-length rows as a micro-batch: every token trained but the first, nothing padded."""
    rows = np.asarray(rows, dtype=np.int64).tolist()
    return collate([{"input_ids": row, "labels": row_labels(row)} for row in rows], pad_id=0)


def collate_packed(rows: Sequence[dict[str, Any]], pad_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """A packed micro-batch: input_ids, labels, position_ids and sequence_ids, each (rows, width).

    sequence_ids numbers the examples of a row from 1 and marks padding 0; it is bookkeeping (real-token counts,
    tests) and is never given to the model. Padding gets its own restarting positions so it forms its own block.

    `max_length` None: one row of every example, nothing padded, and `cu_seq_lens_q` (0, n1, n1 + n2, ...), where
    the examples start: for a model that attends example by example (model/attention.py), whose cost then does not
    grow with the row.
    """
    lengths = [len(r["input_ids"]) for r in rows]
    layout = [list(range(len(rows)))] if max_length is None else pack_rows(lengths, max_length)
    width = max(sum(lengths[i] for i in row) for row in layout)
    shape = (len(layout), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    sequence_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(layout):
        start = 0
        for number, i in enumerate(row, start=1):
            n = lengths[i]
            input_ids[r, start:start + n] = torch.as_tensor(rows[i]["input_ids"])
            labels[r, start:start + n] = torch.as_tensor(rows[i]["labels"])
            labels[r, start] = IGNORE
            position_ids[r, start:start + n] = torch.arange(n)
            sequence_ids[r, start:start + n] = number
            start += n
        position_ids[r, start:] = torch.arange(width - start)
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "sequence_ids": sequence_ids}
    if max_length is None:
        batch["cu_seq_lens_q"] = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return batch


def examples_at(dataset, indices: list[int]) -> list[dict[str, Any]]:
    columns = dataset.select_columns(["input_ids", "labels"])[indices]
    return [{"input_ids": ids, "labels": labels} for ids, labels in zip(columns["input_ids"], columns["labels"])]


def fetch_batch(dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows `indices` of a tokenised dataset as a micro-batch padded to its longest example."""
    return collate(examples_at(dataset, indices), pad_id)


def fetch_packed(dataset, indices: list[int], pad_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """Rows `indices` of a tokenised dataset packed into rows of up to `max_length` tokens (None: one row)."""
    return collate_packed(examples_at(dataset, indices), pad_id, max_length)


def fetch_rows(store, ids: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """The loop's `fetch(dataset, indices, pad_id)` for a raw-text row store (rows need no padding)."""
    return collate_rows(store.rows(ids))


def batch_fetcher(packing: bool, max_length: int, one_row: bool = False
                  ) -> Callable[[Any, list[int], int], dict[str, torch.Tensor]]:
    """fetch(dataset, indices, pad_id) -> micro-batch: padded to its longest example; or packed, into rows of up to
    `max_length`, or into `one_row` for a model that attends example by example."""
    if not packing:
        return fetch_batch
    return partial(fetch_packed, max_length=None if one_row else max_length)
