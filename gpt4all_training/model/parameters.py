"""Counting a model's parameters and grouping them for the optimizer.

A parameter's size is the backend's to say (`parameter_shape`, `held_elements`): under ZeRO-3 the tensor in the
module is a flat partition of it. The defaults here take the tensor as it is, as in one process.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

Shape = Callable[[torch.Tensor], torch.Size]


def whole_shape(param: torch.Tensor) -> torch.Size:
    return param.shape


def count_parameters(model: nn.Module, shape: Shape = whole_shape) -> tuple[int, int]:
    """(trainable, total) elements, each parameter counted at its whole `shape`; a 4-bit quantized weight by the
    weights it holds (its quantization state's shape), not by its packed storage."""
    sizes = [(math.prod(logical_shape(p, shape)), p.requires_grad) for p in model.parameters()]
    return sum(size for size, trainable in sizes if trainable), sum(size for size, _ in sizes)


def logical_shape(param: torch.Tensor, shape: Shape) -> torch.Size:
    state = getattr(param, "quant_state", None)  # bitsandbytes' Params4bit: two weights per byte of storage
    return state.shape if state is not None else shape(param)


def resident_parameters(model: nn.Module, held: Callable[[torch.Tensor], int] = torch.numel) -> int:
    """Parameter elements this process holds (`held` of each: its partition where the backend partitions), a 4-bit
    weight's storage counted by the weights it packs."""
    return sum(held(p) * weights_per_element(p) for p in model.parameters())


def weights_per_element(param: torch.Tensor) -> int:
    """Weights one element of `param` stores: two per byte in a 4-bit quantized weight, whatever its storage dtype."""
    return 2 * param.element_size() if getattr(param, "quant_state", None) is not None else 1


def param_groups(model: nn.Module, weight_decay: float, shape: Shape = whole_shape) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm weights and embeddings are exempt (as mesh-transformer-jax and CodeParrot).
    A parameter's rank is that of its whole `shape`."""
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (no_decay if len(shape(param)) < 2 or id(param) in no_decay_ids else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
