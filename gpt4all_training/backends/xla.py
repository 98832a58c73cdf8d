"""XLA (a TPU, or PJRT_DEVICE=CPU): fixed batch widths, one graph per optimizer step, and CPU copies for saving."""

from __future__ import annotations

from typing import Any

import torch

from gpt4all_training.backends.backend import Backend, rebuilt_copy, to_cpu

# Filler of each batch key when a batch is widened to its bucket: padding is never attended to by real tokens
# (causal, right-padded) and never trained.
PAD_VALUES = {"labels": -100}
SMALLEST_BUCKET = 64


def bucket_width(width: int) -> int:
    """The padded width of a batch under XLA: the next power of two (at least 64). XLA compiles one graph per input
    shape, so padding to a few fixed widths bounds the compilations (log2 of max_length of them) instead of
    compiling anew for every batch width."""
    return max(SMALLEST_BUCKET, 1 << (width - 1).bit_length())


class XlaBackend(Backend):
    """The Accelerator on an XLA device; otherwise like one process or DDP."""

    # Selecting the trained positions gives every batch a shape of its own, and XLA compiles a graph per shape: the
    # loss projects every position through the whole head instead (fixed shapes, one graph per bucket).
    chunks_output_head = False

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` widened to its bucket, then on the XLA device: no recompiles for new widths."""
        width = batch["input_ids"].shape[1]
        extra = bucket_width(width) - width
        batch = {k: torch.nn.functional.pad(v, (0, extra), value=PAD_VALUES.get(k, 0)) if v.dim() == 2 else v
                 for k, v in batch.items()}
        return super().to_device(batch)

    def step_boundary(self) -> None:
        """Cut the lazily traced graph here, so each optimizer step (or evaluation batch) is one graph that compiles
        once and replays."""
        import torch_xla

        torch_xla.sync()

    def step_metrics(self) -> dict[str, int]:
        """{"xla_compilations": graphs compiled so far by this process}: a count that keeps growing after the first
        steps means shapes are not static and every step pays for a compilation."""
        import torch_xla.debug.metrics as metrics

        data = metrics.metric_data("CompileTime")
        return {"xla_compilations": int(data[0]) if data else 0}

    def saveable_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Moved to the CPU: safetensors cannot write XLA tensors."""
        return to_cpu(super().saveable_state_dict(model))

    def optimizer_state_dict(self, optimizer) -> dict[str, Any]:
        """On the CPU: XLA tensors cannot be pickled (load_state_dict moves it back)."""
        return to_cpu(optimizer.state_dict())

    def whole_copy(self, unwrapped, state_dict: dict[str, torch.Tensor]):
        """The in-memory tensors live on the XLA device: a whole CPU copy from `state_dict`."""
        return rebuilt_copy(unwrapped, state_dict)
