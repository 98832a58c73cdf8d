"""One optimizer step over this rank's micro-batches.

The loss of an optimizer step is weighted over everything the step trains on: the sum of the losses of all its
micro-batches on all ranks, divided by the total count of what they sum over, which the objective says (trained
tokens for sft and causal_lm, pairs for dpo). So batch 4 x accumulation 1, batch 1 x accumulation 4 and 2 ranks x
batch 2 all take the same step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Protocol

import torch

from gpt4all_training.batch import real_token_count, trained_token_count
from gpt4all_training.errors import TrainingError
from gpt4all_training.training.loss import token_loss_sum

# The optimizer's parameter groups in the order model.loading.param_groups builds them.
PARAM_GROUP_NAMES = ("decay", "no_decay")


class SteppingBackend(Protocol):
    """What an optimizer step asks the run's backend (backends/backend.py)."""

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def micro_batch(self, model, last: bool) -> contextlib.AbstractContextManager[None]: ...

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor: ...

    def clip_grad_norm(self, model, max_norm: float | None) -> float: ...

    def parameter_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor: ...

    def step_boundary(self) -> None: ...


def group_grad_norms(optimizer, backend: SteppingBackend) -> dict[str, torch.Tensor]:
    """Per parameter group, the gradient norm of each of its parameters (float32, on the CPU). A collective where
    the backend shards gradients."""
    norms = {}
    for i, group in enumerate(optimizer.param_groups):
        name = PARAM_GROUP_NAMES[i] if i < len(PARAM_GROUP_NAMES) else f"group{i}"
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if grads:
            norms[name] = backend.parameter_norms(grads)
    return norms


def train_step(model, batches: list[dict[str, torch.Tensor]], backend: SteppingBackend, optimizer, scheduler,
               max_grad_norm: float | None, step: int, loss_fn=token_loss_sum, nan_policy: str = "stop",
               grad_norms: bool = False, count=trained_token_count) -> dict[str, Any]:
    """One optimizer step. `loss_fn(model, batch)` is a micro-batch's loss summed over what `count(batch)` counts.
    Returns the global step loss (that sum over all micro-batches and ranks, divided by their total count), the
    token counts and the gradient norm before clipping (a tensor on the device, or a number: `float()` it where it
    is logged); with `grad_norms`, also "group_grad_norms" (group_grad_norms before clipping) when the gradients
    are finite.

    A non-finite loss stops the run, or with nan_policy "skip" drops this step's update: every rank sees the same
    reduced loss, so all of them skip together, and the scheduler still steps (the lr stays a function of the step).
    """
    counts = [float(sum(count(b) for b in batches)), float(sum(trained_token_count(b) for b in batches)),
              float(sum(real_token_count(b) for b in batches)), float(sum(b["input_ids"].numel() for b in batches))]
    if backend.world_size > 1:  # the device round trip (a host sync on a GPU) only where there are ranks to sum
        counts = backend.reduce(torch.tensor(counts, dtype=torch.float64, device=backend.device)).tolist()
    n_counted, n_trained, n_real, n_padded = counts
    # DDP averages gradients over ranks; scaling by the world size makes the result sum/global-count exactly.
    scale = backend.world_size / max(n_counted, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=backend.device)
    for i, batch in enumerate(batches):
        batch = backend.to_device(batch)  # under XLA padded to a fixed width bucket: no recompiles
        with backend.micro_batch(model, last=i == len(batches) - 1):
            with backend.autocast():
                micro_loss = loss_fn(model, batch)
            backend.backward(micro_loss * scale)
        loss_sum += micro_loss.detach().double()
    loss = (backend.reduce(loss_sum) / max(n_counted, 1.0)).item()
    skipped = not math.isfinite(loss)
    if skipped and nan_policy != "skip":
        raise TrainingError(f"step {step + 1}: the loss is {loss}; lower lr, check the data, or use float32")
    result: dict[str, Any] = {}
    if grad_norms and not skipped:
        result["group_grad_norms"] = group_grad_norms(optimizer, backend)
    grad_norm = float("nan") if skipped else backend.clip_grad_norm(model, max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    if not skipped:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    backend.step_boundary()  # XLA: one graph per step
    # The norm stays where the backend computed it: reading it (meter.row, on logging rows) waits for the device.
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm if grad_norm is not None else float("nan"),
            "n_trained": n_trained, "n_real": n_real, "n_padded": n_padded, "skipped": int(skipped), **result}
