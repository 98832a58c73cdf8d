"""The optimizer a run steps, by the `optimizer` key: AdamW (torch's multi-tensor `foreach` implementation, or its
fused kernel), bitsandbytes' 8-bit AdamW (moments stored blockwise-quantized: a quarter of AdamW's state memory), or
plain SGD. Each takes the same parameter groups (weight decay on matrices only) and the lr the schedule sets."""

from __future__ import annotations

from typing import Any

import torch

from gpt4all_training.errors import UserError

BETAS, EPS = (0.9, 0.999), 1e-8


def build_optimizer(name: str, groups: list[dict[str, Any]], lr: float, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `name` over `groups`, for parameters that will live on `device`; where it cannot run there,
    one line that says so and what to use."""
    if name == "sgd":  # as transformers' optim="sgd": no momentum, decay added to the gradient
        return torch.optim.SGD(groups, lr=lr)
    if name == "adamw_8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise UserError("optimizer: adamw_8bit needs bitsandbytes, which is not installed here; "
                            "pip install bitsandbytes==0.50.2, or use adamw") from None
        return bitsandbytes.optim.AdamW8bit(groups, lr=lr, betas=BETAS, eps=EPS)
    if name == "adamw_fused":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = _get_fused_kernels_supported_devices()
        if device.type not in supported:
            raise UserError(f"optimizer: adamw_fused has no kernel on {device.type} (torch has one on "
                            f"{', '.join(supported)}); use adamw")
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, foreach=True)
