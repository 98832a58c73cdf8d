"""Attention over a packed row, one example at a time: what lets packing on a CPU lay a micro-batch out as one row
with no padding at all.

A packed row attends through SDPA with a block-diagonal causal mask (data/batching.py), and that kernel computes
every masked-out block: a row of examples costs as much attention as one example of the row's length. So packing
into rows of at most `max_length` tokens is a compromise between that waste and padding the rows to the longest.
Attending example by example (SDPA, causal, on each example's slice of the queries, keys and values) costs only the
examples' own attention, so a micro-batch can be one row of all its examples, nothing padded.

The batch says where its examples start: `cu_seq_lens_q`, the cumulative lengths (0, n1, n1 + n2, ...) with
transformers' name for them (the key flash-attention's variable-length kernels read). A call without it (a padded
batch, generation with its cache, the isolation check's position-only batch) is plain SDPA with its mask. The model's
mask function stays SDPA's, so a model whose attention never receives the key still keeps the examples apart by
their restarting position ids.

Reading the boundaries is a host copy of a small tensor per layer: free on a CPU, a device sync on a GPU, which is
why only backends on a CPU ask for it (`Backend.attends_per_example`); a GPU's varlen kernels do the same work in one
launch.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from gpt4all_training.model.wrappers import unwrap_model

PER_EXAMPLE = "sdpa_per_example"


def per_example_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (batch, heads, length, head_dim) in, (batch, length, heads, head_dim)
    out. With `cu_seq_lens_q` the batch is one row of whole examples back to back, each attended causally alone."""
    bounds = [] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    window = kwargs.get("sliding_window")
    if not bounds or (window is not None and max(b - a for a, b in zip(bounds, bounds[1:])) > window):
        # No starts given, or a sliding window that cuts into an example: the mask says what each query sees.
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outputs = [sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                      None, is_causal=True, **kwargs)[0]
               for start, end in zip(bounds, bounds[1:])]
    return torch.cat(outputs, dim=1), None


def attends_per_example(model: torch.nn.Module) -> bool:
    return getattr(unwrap_model(model).config, "_attn_implementation", None) == PER_EXAMPLE


def attend_per_example(model: torch.nn.Module) -> None:
    """Give `model` the per-example attention where it attends through SDPA (a model on eager attention, such as
    one whose logits are soft-capped, keeps it, and its packed batches keep their rows). Idempotent."""
    base = unwrap_model(model)
    if getattr(base.config, "_attn_implementation", None) not in ("sdpa", PER_EXAMPLE):
        return
    if PER_EXAMPLE not in AttentionInterface._global_mapping:
        AttentionInterface.register(PER_EXAMPLE, per_example_attention)
        AttentionMaskInterface.register(PER_EXAMPLE, sdpa_mask)
    base.set_attn_implementation(PER_EXAMPLE)  # type: ignore[operator]
