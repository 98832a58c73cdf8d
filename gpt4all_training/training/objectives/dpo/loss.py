"""The preference losses of a micro-batch of pairs, the rewards they log, and the validation on held-out pairs (the
formulas: this package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import Preference
from gpt4all_training.data.pairs import fetch_pairs
from gpt4all_training.training.loss import sequence_logps
from gpt4all_training.training.objectives.protocol import Batch

# What the training window and the validation sum per pair, in this order.
SUMS = ("pairs", "chosen_rewards", "rejected_rewards", "correct", "chosen_logps", "rejected_logps")


@dataclass(frozen=True)
class PreferenceSettings:
    loss_type: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    sft_weight: float

    @classmethod
    def of(cls, config: Preference) -> PreferenceSettings:
        assert config.loss_type is not None and config.beta is not None, "TrainConfig fills the objective's defaults"
        return cls(config.loss_type, config.beta, config.label_smoothing, config.simpo_gamma, config.sft_weight)


@dataclass
class PairTerms:
    """Per pair of a micro-batch: its loss, the two rewards, and the policy's two log-probabilities."""
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor

    def sums(self) -> torch.Tensor:
        """SUMS over the micro-batch's pairs (float64, without gradient)."""
        with torch.no_grad():
            values = [torch.tensor(float(self.losses.numel())), self.chosen_rewards.sum(),
                      self.rejected_rewards.sum(), (self.chosen_rewards > self.rejected_rewards).sum(),
                      self.chosen_logps.sum(), self.rejected_logps.sum()]
            return torch.stack([v.double().cpu() for v in values])


def pair_losses(policy: torch.Tensor, reference: Optional[torch.Tensor], lengths: torch.Tensor,
                settings: PreferenceSettings) -> PairTerms:
    """The loss terms of B pairs from 2B log-probabilities (chosen first) of the policy and the reference (None for
    simpo), and the 2B answers' trained-token counts."""
    pi_c, pi_r = policy.chunk(2)
    n_c, n_r = lengths.to(policy).chunk(2)
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.loss_type == "simpo":
        chosen, rejected = beta * pi_c / n_c, beta * pi_r / n_r
        margin = chosen - rejected - settings.simpo_gamma
    else:
        assert reference is not None  # only simpo has none
        ref_c, ref_r = reference.to(policy).chunk(2)
        ratio_c, ratio_r = pi_c - ref_c, pi_r - ref_r
        chosen, rejected = beta * ratio_c, beta * ratio_r
        margin = beta * (ratio_c - ratio_r)
    if settings.loss_type == "ipo":
        losses = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)
    if settings.sft_weight:
        losses = losses - settings.sft_weight * pi_c / n_c
    return PairTerms(losses, chosen.detach(), rejected.detach(), pi_c.detach(), pi_r.detach())


def answer_lengths(batch: Batch) -> torch.Tensor:
    """Each row's count of trained tokens."""
    return (batch["labels"][:, 1:] != IGNORE).sum(1)


class PreferenceLoss:
    """The loop's `loss_fn(model, batch)` for pairs: the sum of the pairs' losses (the loop divides by the step's
    pairs). It keeps SUMS over the pairs since window_metrics last read them."""

    def __init__(self, settings: PreferenceSettings, reference: Optional[Callable[[Any, Batch], torch.Tensor]]):
        self.settings, self.reference = settings, reference
        self.window = torch.zeros(len(SUMS), dtype=torch.float64)

    def terms(self, model, batch: Batch) -> PairTerms:
        reference = self.reference(model, batch) if self.reference is not None else None
        return pair_losses(sequence_logps(model, batch), reference, answer_lengths(batch), self.settings)

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        terms = self.terms(model, batch)
        self.window += terms.sums()
        return terms.losses.sum()

    def window_metrics(self, backend) -> dict[str, float]:
        """The rewards and log-probabilities since the last call, each a mean over the pairs of every rank (a
        collective: every rank calls it), then reset."""
        totals = backend.reduce(self.window.to(backend.device)).cpu()
        self.window.zero_()
        return reward_metrics(totals)


def reward_metrics(totals: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's names for the means of SUMS over pairs."""
    pairs, chosen, rejected, correct, chosen_logps, rejected_logps = totals.tolist()
    if not pairs:
        return {}
    return {f"{prefix}rewards/chosen": chosen / pairs, f"{prefix}rewards/rejected": rejected / pairs,
            f"{prefix}rewards/margins": (chosen - rejected) / pairs, f"{prefix}rewards/accuracies": correct / pairs,
            f"{prefix}logps/chosen": chosen_logps / pairs, f"{prefix}logps/rejected": rejected_logps / pairs}


class PairValidation:
    """Validation of pairs: the preference loss per pair, and the reward metrics, on held-out pairs."""
    width = 1 + len(SUMS)  # the loss sum, then SUMS

    def __init__(self, loss: PreferenceLoss) -> None:
        self.loss = loss

    def fetch(self, dataset, indices: list[int], pad_id: int) -> Batch:
        return fetch_pairs(dataset, indices, pad_id)

    def sums(self, model, batch: Batch) -> torch.Tensor:
        terms = self.loss.terms(model, batch)
        return torch.cat([terms.losses.sum().double().cpu()[None], terms.sums()])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        pairs = totals[1].item()
        return {"val_loss": totals[0].item() / pairs if pairs else float("nan"),
                **reward_metrics(totals[1:], "val_"), "val_pairs": int(pairs)}
