"""grpo's policy loss (the formulas: this package's docstring), what the step divides it by, and the
log-probabilities it compares with that are fixed when the rows are sampled: those of the weights that sampled
(num_iterations > 1) and of the reference (beta > 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from gpt4all_training.batch import IGNORE, trained_token_count
from gpt4all_training.training.loss import token_logps
from gpt4all_training.training.objectives.protocol import Batch
from gpt4all_training.training.objectives.shared import peft_model


@dataclass(frozen=True)
class PolicySettings:
    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float

    @classmethod
    def of(cls, config) -> PolicySettings:
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        return cls(config.loss_type, config.beta, config.epsilon, high, config.temperature)


# The policy loss's window: sums over completion tokens since window_metrics last read them.
LOSS_SUMS = ("tokens", "kl", "entropy", "clip_low", "clip_high", "sampling_difference")


class PolicyLoss:
    """The loop's `loss_fn(model, batch)` for sampled rows: the clipped policy loss summed as the loss_type's count
    divides it (see the package's docstring). It keeps LOSS_SUMS since window_metrics last read them, and the largest
    |sampled log-probability - the sampling weights' own| (old)."""

    def __init__(self, settings: PolicySettings, reference: Optional[Callable[[Any, Batch], torch.Tensor]] = None):
        self.settings, self.reference = settings, reference
        self.window = torch.zeros(len(LOSS_SUMS), dtype=torch.float64)
        self.largest_difference = 0.0

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        s = self.settings
        logps, entropies = token_logps(model, batch, s.temperature)
        mask = (batch["labels"][:, 1:] != IGNORE).to(logps)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        ratio = torch.exp(logps - old)
        advantages = batch["advantages"][:, None].to(logps)
        clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.zeros_like(per_token)
        if s.beta:
            gap = batch["ref_logps"] - logps
            # Times the ratio (TRL 1.16's default, DeepSeek-V3.2's correction): the gradient of the unbiased
            # reverse-KL estimate, which differs from the plain term's even where the ratio is exactly 1.
            kl = (torch.exp(gap) - gap - 1) * ratio
            per_token = per_token + s.beta * kl
        if s.loss_type == "grpo":
            loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum()
        else:  # dapo, dr_grpo: token sums; the step divides by its tokens, or by max_completion_length x rows
            loss = (per_token * mask).sum()
        with torch.no_grad():
            difference = (batch["sampled_logps"] - old).abs() * mask
            self.largest_difference = max(self.largest_difference, float(difference.max()))
            sums = [mask.sum(), (kl * mask).sum(), (entropies * mask).sum(),
                    ((ratio < 1 - s.epsilon_low) & (advantages < 0)).to(mask).mul(mask).sum(),
                    ((ratio > 1 + s.epsilon_high) & (advantages > 0)).to(mask).mul(mask).sum(), difference.sum()]
            self.window += torch.stack([v.double().cpu() for v in sums])
        return loss


def row_count(batch: Batch) -> int:
    """Completions in a micro-batch: what loss_type grpo's loss is a mean over."""
    return batch["input_ids"].shape[0]


def counter(loss_type: str, max_completion_length: int) -> Callable[[Batch], int]:
    """What the step's summed loss is divided by, summed over its micro-batches on every process (the package's
    docstring)."""
    if loss_type == "dapo":
        return trained_token_count
    if loss_type == "grpo":
        return row_count
    return lambda batch: row_count(batch) * max_completion_length


@torch.no_grad()
def add_fixed_logps(batches: list[Batch], model, backend, temperature: float, old: bool, reference: Optional[str],
                    frozen) -> None:
    """Add, per micro-batch, the log-probabilities of the weights that sampled (`old`: num_iterations > 1, the
    ratio's denominator while the weights move) and of the `reference` ("adapter" or "frozen_copy", the `frozen`
    module; None: none), from the module being trained (in train mode, its dropout off) or the frozen copy, as the
    loss computes its own."""
    if not old and reference is None:
        return
    module = backend.unwrap(model)
    for batch in batches:
        on_device = backend.to_device(batch)
        with backend.autocast():
            if old:
                batch["old_logps"] = token_logps(module, on_device, temperature)[0].cpu()
            if reference == "adapter":
                with peft_model(module).disable_adapter():
                    batch["ref_logps"] = token_logps(module, on_device, temperature)[0].cpu()
            elif reference == "frozen_copy":
                batch["ref_logps"] = token_logps(frozen, on_device, temperature)[0].cpu()
