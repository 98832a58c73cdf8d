"""Token-weighted validation loss across all ranks: sum of token losses over sum of trained tokens."""

from __future__ import annotations

import math

import torch

from gpt4all_training.data.sft import fetch_batch
from gpt4all_training.backends.accelerate import device_batch, step_boundary
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
def evaluate_loss(model, dataset, accelerator, batch_size: int, pad_id: int,
                  max_batches: int | None = None) -> dict[str, float]:
    """{"val_loss", "val_ppl", "val_tokens"}; logits are never kept across batches."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    n_tokens = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for indices, real in eval_batches(len(dataset), batch_size, accelerator.num_processes,
                                      accelerator.process_index, max_batches):
        batch = fetch_batch(dataset, indices, pad_id)
        batch = device_batch(batch, accelerator)  # under XLA padded to a fixed width bucket: no recompiles
        with accelerator.autocast():
            loss = token_loss_sum(model, batch)
        if real:
            loss_sum += loss.double()
            n_tokens += (batch["labels"][:, 1:] != -100).sum()
        step_boundary(accelerator)  # XLA: one graph per batch
    totals = accelerator.reduce(torch.stack([loss_sum, n_tokens]), reduction="sum")
    if was_training:
        model.train()
    loss_value = (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")
    return {"val_loss": loss_value, "val_ppl": math.exp(min(loss_value, 50.0)), "val_tokens": int(totals[1])}
