"""Validation across all ranks: the objective's sums over the validation split, reduced, then its metrics. For sft
and causal_lm the token-weighted loss: sum of token losses over sum of trained tokens."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Protocol

import torch

from gpt4all_training.backends.backend import ProcessRanks
from gpt4all_training.batch import IGNORE
from gpt4all_training.config.blocks import Evaluation
from gpt4all_training.data.batching import fetch_batch
from gpt4all_training.progress import progress
from gpt4all_training.training.loss import token_loss_sum


class Validation(Protocol):
    """What an objective measures on its validation split."""
    width: int  # how many sums `sums` returns

    def fetch(self, dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]: ...

    def sums(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A 1-D float64 tensor of sums over the batch; summed over batches and ranks, `metrics` reads them."""
        ...

    def metrics(self, totals: torch.Tensor) -> dict[str, float]: ...


class TokenValidation:
    """The validation loss of next-token prediction: NLL per trained token, and its perplexity."""
    width = 2  # NLL sum, trained tokens

    def fetch(self, dataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        return fetch_batch(dataset, indices, pad_id)

    def sums(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = token_loss_sum(model, batch).double()
        return torch.stack([loss, (batch["labels"][:, 1:] != IGNORE).sum().to(loss)])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        loss = (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(totals[1])}


def eval_batches(n_examples: int, batch_size: int, world_size: int, rank: int,
                 max_batches: int | None) -> list[tuple[list[int], bool]]:
    """This rank's share of each global validation batch, in order: (indices, real).

    Every rank gets the same number of batches, since sharded engines (ZeRO-3) need every rank in every forward.
    A rank whose share of the last batch is empty re-reads one row with `real=False`, and its loss is not counted.
    """
    global_batch = batch_size * world_size
    n_batches = math.ceil(n_examples / global_batch)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    out = []
    for b in range(n_batches):
        rows = list(range(b * global_batch, min(n_examples, (b + 1) * global_batch)))
        share = rows[rank::world_size]
        out.append((share, True) if share else (rows[:1], False))
    return out


class EvaluatingBackend(ProcessRanks, Protocol):
    """What validation asks the run's backend (backends/backend.py)."""

    @property
    def device(self) -> torch.device: ...

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor: ...

    def step_boundary(self) -> None: ...


@torch.no_grad()
def evaluate_loss(model, dataset, backend: EvaluatingBackend, batch_size: int, pad_id: int,
                  max_batches: int | None = None, validation: Validation | None = None) -> dict[str, Any]:
    """The validation metrics (by default TokenValidation's: {"val_loss", "val_ppl", "val_tokens"}); logits are
    never kept across batches. A "validation" bar counts the batches; the caller's line reports the result."""
    validation = validation or TokenValidation()
    was_training = model.training
    model.eval()
    totals = torch.zeros(validation.width, dtype=torch.float64, device=backend.device)
    batches = eval_batches(len(dataset), batch_size, backend.world_size, backend.rank, max_batches)
    with progress("validation", len(batches), backend.is_main_process, leave=None) as bar:
        for indices, real in batches:
            batch = backend.to_device(validation.fetch(dataset, indices, pad_id))  # XLA: a fixed width bucket
            with backend.autocast():
                sums = validation.sums(model, batch)
            if real:
                totals += sums.double()
            backend.step_boundary()  # XLA: one graph per batch
            bar.update(1)
    totals = backend.reduce(totals)
    if was_training:
        model.train()
    return validation.metrics(totals.cpu())


class Evaluator:
    """The objective's validation on the validation split: due every eval_every steps and at the last step."""

    def __init__(self, settings: Evaluation, batch_size: int, backend: EvaluatingBackend, dataset, pad_id: int,
                 total_steps: int, log, validation: Validation | None = None) -> None:
        self.backend, self.dataset, self.pad_id, self.total_steps, self.log = backend, dataset, pad_id, total_steps, log
        self.every, self.batch_size, self.max_batches = settings.eval_every, batch_size, settings.eval_steps
        self.validation = validation or TokenValidation()
        self.last: dict[str, float] = {}  # the latest result, for the run's summary

    def due(self, step: int) -> bool:
        return len(self.dataset) > 0 and (self.every is not None and step % self.every == 0 or step == self.total_steps)

    def run(self, model, step: int) -> dict[str, float]:
        self.last = evaluate_loss(model, self.dataset, self.backend, self.batch_size, self.pad_id, self.max_batches,
                                  self.validation)
        described = " ".join(f"{key} {value:.4f}" for key, value in self.last.items() if isinstance(value, float))
        self.log(f"step {step}: {described}")
        return self.last
