"""Counting a model's parameters (ZeRO-3 partitions included) and grouping them for the optimizer."""

from __future__ import annotations

from typing import Any

from torch import nn


def count_parameters(model: nn.Module) -> tuple[int, int]:
    # Under ZeRO-3 a partitioned parameter is empty here; DeepSpeed keeps its real size in ds_numel.
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return trainable, total


def resident_parameters(model: nn.Module) -> int:
    """Parameter elements this process holds: its partitions under ZeRO-3 (ds_tensor), otherwise all of them."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm weights and embeddings are exempt (as mesh-transformer-jax and CodeParrot)."""
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        ndim = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partition is flat; ds_shape is the real one
        (no_decay if ndim < 2 or id(param) in no_decay_ids else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
