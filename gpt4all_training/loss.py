"""Token-level cross-entropy sums. Loss normalisation happens in the loop, over the trained tokens of a whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}


def trained_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Positions that are predicted and trained: labels after the causal shift that are not IGNORE."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token NLL over the trained positions of `batch` (fp32 maths whatever the autocast dtype)."""
    logits = model(**model_inputs(batch)).logits
    shifted = logits[:, :-1].float()
    targets = batch["labels"][:, 1:].to(shifted.device)
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
