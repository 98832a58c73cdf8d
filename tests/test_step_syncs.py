"""What a training step makes the host wait for, and that removing those waits changed no number: a step reads the
device only for its loss (the non-finite check) and for the positions the chunked head trains; the gradient norm is
read where it is logged; and LoRA with dropout 0 draws no dropout masks."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from support.models import build_tiny_gptj, build_tiny_llama
from gpt4all_training.batch import IGNORE, model_inputs, real_token_count, trained_token_count
from gpt4all_training.data.batching import collate_packed
from gpt4all_training.data.records import load_records
from gpt4all_training.data.sft import tokenize_dataset
from gpt4all_training.errors import TrainingError
from gpt4all_training.training.loss import chunked_loss_and_z, head_removed, output_head, token_loss_sum
from gpt4all_training.training.step import train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_profile  # noqa: E402


@pytest.fixture(scope="module")
def batches(clean_dolly, tokenizer) -> list[list[dict]]:
    """Three steps of two packed micro-batches each, from real tokenised Dolly examples."""
    records = load_records(str(clean_dolly)).select(range(24))
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]}
            for r in tokenize_dataset(records, tokenizer, 96, "plain", None)]
    return [[collate_packed(rows[i:i + 4], 0, 96), collate_packed(rows[i + 4:i + 8], 0, 96)]
            for i in range(0, 24, 8)]


def backend():
    from accelerate import Accelerator

    from gpt4all_training.backends.accelerate import backend_for

    return backend_for(Accelerator(cpu=True))


# ---------------------------------------------------------------- the code before the host syncs were removed

def previous_token_loss_sum(model, batch):
    """token_loss's chunked path as it was: two boolean-mask selections (each its own nonzero)."""
    targets = batch["labels"][:, 1:]
    parent, name, head = output_head(model)
    with head_removed(parent, name):
        hidden = model(**model_inputs(batch)).logits[:, :-1]
    trained = targets != IGNORE
    return chunked_loss_and_z(hidden[trained], head, targets[trained])[0]


def previous_train_step(model, batches, backend, optimizer, scheduler, max_grad_norm, step):
    """train_step as it was for sft: the counts through the backend's reduce, the norm read at once."""
    local = torch.tensor([sum(trained_token_count(b) for b in batches), sum(trained_token_count(b) for b in batches),
                          sum(real_token_count(b) for b in batches), sum(b["input_ids"].numel() for b in batches)],
                         dtype=torch.float64, device=backend.device)
    n_counted, n_trained, n_real, n_padded = backend.reduce(local).tolist()
    scale = backend.world_size / max(n_counted, 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=backend.device)
    for i, batch in enumerate(batches):
        batch = backend.to_device(batch)
        with backend.micro_batch(model, last=i == len(batches) - 1):
            with backend.autocast():
                micro_loss = previous_token_loss_sum(model, batch)
            backend.backward(micro_loss * scale)
        loss_sum += micro_loss.detach().double()
    loss = (backend.reduce(loss_sum) / max(n_counted, 1.0)).item()
    if not math.isfinite(loss):
        raise TrainingError(f"step {step + 1}: the loss is {loss}")
    grad_norm = backend.clip_grad_norm(model, max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "lr": lr, "grad_norm": float(grad_norm), "n_trained": n_trained, "n_real": n_real,
            "n_padded": n_padded}


def three_steps(tokenizer, batches, step_fn, loss_fn=None):
    model = build_tiny_gptj(tokenizer, seed=3).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    kwargs = {"loss_fn": loss_fn} if loss_fn else {}
    results = [step_fn(model, micro, backend(), optimizer, scheduler, 1.0, i, **kwargs)
               for i, micro in enumerate(batches)]
    return results, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_steps_equal_the_previous_code(tokenizer, batches):
    """Three steps (two micro-batches each, clipping, AdamW) give the previous code's losses, norms, counts and
    weights, within the difference between two runs of the previous code (on a CPU: none, so exactly)."""
    reference, reference_weights = three_steps(tokenizer, batches, previous_train_step)
    again, again_weights = three_steps(tokenizer, batches, previous_train_step)
    tolerance = max((reference_weights[k] - again_weights[k]).abs().max().item() for k in reference_weights)
    loss_tolerance = max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, again))
    results, weights = three_steps(tokenizer, batches, train_step, token_loss_sum)
    for new, old in zip(results, reference):
        assert isinstance(new["grad_norm"], torch.Tensor)  # not read inside the step
        assert abs(new["loss"] - old["loss"]) <= loss_tolerance
        assert abs(float(new["grad_norm"]) - old["grad_norm"]) <= loss_tolerance
        assert (new["n_trained"], new["n_real"], new["n_padded"]) == (old["n_trained"], old["n_real"],
                                                                       old["n_padded"])
        assert all(isinstance(new[k], float) for k in ("n_trained", "n_real", "n_padded"))
    for name, weight in reference_weights.items():
        assert (weights[name] - weight).abs().max().item() <= tolerance, name


def sync_sites(run) -> dict[str, int]:
    """Sync ops (step_profile.SYNC_OPS) that `run()` makes, by the training code's function that made them
    ("file.py: function")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                record_shapes=True, profile_memory=True) as profiler:
        run()
    sites = step_profile.sync_sites(profiler.events()).items()
    return {re.sub(r"\(\d+\)", "", site.rsplit("/", 1)[-1]): n for site, n in sites
            if "gpt4all_training/training/" in site}


def test_a_step_waits_only_for_its_loss_and_the_trained_positions(tokenizer, batches):
    """In the training code, one step of two micro-batches reads a value off the device three times: the step's
    loss once (its non-finite check), and the trained positions once per micro-batch. Counting tokens happens on
    the host batches (no device round trip on one process), and the gradient norm is not read."""
    model = build_tiny_gptj(tokenizer, seed=3).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sites = sync_sites(lambda: train_step(model, batches[0], backend(), optimizer, scheduler, 1.0, 0))
    assert sites == {"step.py: train_step": 1, "loss.py: token_loss": 2}


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_lora_dropout_zero_draws_no_masks(tokenizer, batches, dropout):
    """lora_dropout 0 takes PEFT's path without dropout (nn.Identity): a training step runs no dropout op at all;
    0.05 draws one mask per adapted layer."""
    from gpt4all_training.model.lora import apply_lora

    model = apply_lora(build_tiny_llama(tokenizer), 4, 8, dropout, ["q_proj", "v_proj"], False).train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        token_loss_sum(model, batches[0][0]).backward()
    masks = [e for e in profiler.events() if e.name in ("aten::bernoulli_", "aten::dropout", "aten::native_dropout")]
    assert len([e for e in masks if e.name == "aten::bernoulli_"]) == (0 if dropout == 0 else 2 * 2)
    if dropout == 0:
        assert masks == []
