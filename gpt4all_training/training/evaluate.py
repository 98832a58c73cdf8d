"""Token-weighted validation loss across all ranks: sum of token losses over sum of trained tokens."""

from __future__ import annotations

import math

import torch

from gpt4all_training.data.batching import fetch_batch
from gpt4all_training.training.loss import token_loss_sum


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


@torch.no_grad()
def evaluate_loss(model, dataset, backend, batch_size: int, pad_id: int,
                  max_batches: int | None = None) -> dict[str, float]:
    """{"val_loss", "val_ppl", "val_tokens"}; logits are never kept across batches."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=backend.device)
    n_tokens = torch.zeros((), dtype=torch.float64, device=backend.device)
    for indices, real in eval_batches(len(dataset), batch_size, backend.world_size, backend.rank, max_batches):
        batch = backend.to_device(fetch_batch(dataset, indices, pad_id))  # XLA: a fixed width bucket, no recompiles
        with backend.autocast():
            loss = token_loss_sum(model, batch)
        if real:
            loss_sum += loss.double()
            n_tokens += (batch["labels"][:, 1:] != -100).sum()
        backend.step_boundary()  # XLA: one graph per batch
    totals = backend.reduce(torch.stack([loss_sum, n_tokens]))
    if was_training:
        model.train()
    loss_value = (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")
    return {"val_loss": loss_value, "val_ppl": math.exp(min(loss_value, 50.0)), "val_tokens": int(totals[1])}


class Evaluator:
    """Validation loss on the validation split: due every eval_every steps and at the last step."""

    def __init__(self, config, backend, dataset, pad_id: int, total_steps: int, log) -> None:
        self.backend, self.dataset, self.pad_id, self.total_steps, self.log = backend, dataset, pad_id, total_steps, log
        self.every, self.batch_size, self.max_batches = config.eval_every, config.batch_size, config.eval_steps
        self.last: dict[str, float] = {}  # the latest result, for the run's summary

    def due(self, step: int) -> bool:
        return len(self.dataset) > 0 and (bool(self.every) and step % self.every == 0 or step == self.total_steps)

    def run(self, model, step: int) -> dict[str, float]:
        self.last = evaluate_loss(model, self.dataset, self.backend, self.batch_size, self.pad_id, self.max_batches)
        self.log(f"step {step}: val_loss {self.last['val_loss']:.4f} val_ppl {self.last['val_ppl']:.2f}")
        return self.last
