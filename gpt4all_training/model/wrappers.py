"""The transformers model inside the wrappers training puts around it."""

from __future__ import annotations

from torch import nn


def unwrap_model(model) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed / compile / PEFT wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model
