"""The micro-batch format every stage shares: a dict of (rows, width) int64 tensors.

Keys:
- `input_ids`: token ids; padding holds the tokenizer's pad id.
- `labels`: the Hugging Face convention (the model shifts them): a trained position holds its own input id, every
  other position IGNORE. Label 0 of a row is always IGNORE, since nothing predicts the first token.
- `attention_mask`: 1 on real tokens, 0 on padding (padded batches and constant-length rows).
- `position_ids` and `sequence_ids`: packed batches instead of an attention mask. Positions restart at 0 for every
  example (and for a row's padding), which is how transformers finds the packed sequences' boundaries;
  sequence_ids number a row's examples from 1 and mark padding 0, bookkeeping that never reaches the model.
- `cu_seq_lens_q`: a packed batch of one row for a model that attends example by example (model/attention.py):
  where its examples start, (0, n1, n1 + n2, ...), int32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only named in annotations: `clean` reads this module's IGNORE without loading torch
    import torch

IGNORE = -100  # the label of a position that is not trained (torch's cross_entropy ignore_index)
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the model is called with. No KV cache: training never reads it, and transformers only reads restarting
    position_ids as packed-sequence boundaries when there is none (with a cache, packed examples would attend to
    each other)."""
    inputs: dict[str, Any] = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}
    return {**inputs, "use_cache": False}


def trained_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Positions that are predicted and trained: labels after the causal shift that are not IGNORE."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def real_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of examples (not padding): the attention mask of a padded batch, sequence_ids > 0 of a packed one."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["sequence_ids"] > 0).sum())
