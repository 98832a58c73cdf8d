"""The chunked cross-entropy: the same loss and gradients as full logits + F.cross_entropy, without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.models import build_tiny_gptj
from gpt4all_training.batch import IGNORE, model_inputs, trained_token_count
from gpt4all_training.data.batching import collate
from gpt4all_training.training.loss import chunked_loss_and_z, head_removed, output_head, token_loss_sum


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def plain_token_loss_sum(model, batch) -> torch.Tensor:
    """The reference: full logits of the batch, shifted, fp32 cross-entropy summed over trained positions."""
    logits = model(**model_inputs(batch)).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


@pytest.fixture
def batch(tokenizer):
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, prompt in ((40, 12), (17, 5), (29, 20)):
        ids = torch.randint(0, len(tokenizer), (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return collate(rows, pad_id=0)


@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 1 << 23])  # one row per chunk, 7 rows, everything at once
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("z_loss", [0.0, 0.1])  # 0.1: far above the usual 1e-4, so a wrong z gradient shows
def test_chunked_equals_full_cross_entropy_values_and_gradients(chunk_elements, with_bias, z_loss):
    g = torch.Generator().manual_seed(1)
    head = nn.Linear(16, 50, bias=with_bias)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)

    chunked, z_sum = chunked_loss_and_z(hidden, head, targets, z_loss, chunk_elements)
    chunked.backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if with_bias else [])
    hidden.grad = None
    head.zero_grad()
    logits = head(hidden)
    lse_squared = torch.logsumexp(logits, dim=-1).pow(2).sum()
    full = F.cross_entropy(logits, targets, reduction="sum") + z_loss * lse_squared
    full.backward()
    expected = [hidden.grad, head.weight.grad] + ([head.bias.grad] if with_bias else [])

    assert relative_error(chunked.detach(), full.detach()) <= 1e-6
    assert relative_error(z_sum, lse_squared.detach()) <= 1e-6
    for got, want in zip(grads, expected):
        assert relative_error(got, want) <= 1e-6


def test_token_loss_sum_equals_full_logits_on_the_tiny_model(tokenizer, batch):
    model = build_tiny_gptj(tokenizer)
    assert output_head(model) is not None  # the chunked path is the one under test
    loss = token_loss_sum(model, batch)
    loss.backward()
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = plain_token_loss_sum(model, batch)
    reference.backward()
    assert relative_error(loss.detach(), reference.detach()) <= 1e-6
    for name, param in model.named_parameters():
        if param.grad is not None and param.grad.abs().max() > 0:
            assert relative_error(chunked_grads[name], param.grad) <= 1e-6, name
        else:
            assert chunked_grads[name] is None or chunked_grads[name].abs().max() == 0, name


def test_token_loss_sum_with_lora_trains_only_the_adapter(tokenizer, batch):
    from gpt4all_training.model.lora import apply_lora

    model = apply_lora(build_tiny_gptj(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"], False)
    assert output_head(model) is not None
    loss = token_loss_sum(model, batch)
    loss.backward()
    assert model.get_base_model().lm_head.weight.grad is None
    lora_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    reference = plain_token_loss_sum(model, batch)
    reference.backward()
    assert relative_error(loss.detach(), reference.detach()) <= 1e-6
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad.abs().max() > 0:
            assert relative_error(lora_grads[name], param.grad) <= 1e-6, name


def test_evaluation_under_no_grad_gives_the_same_value(tokenizer, batch):
    model = build_tiny_gptj(tokenizer)
    with torch.no_grad():
        value = token_loss_sum(model, batch)
        reference = plain_token_loss_sum(model, batch)
    assert not value.requires_grad
    assert relative_error(value, reference) <= 1e-6
    assert trained_token_count(batch) == 28 + 12 + 9  # response tokens: 40-12, 17-5, 29-20


def test_bf16_autocast_matches_the_plain_path_in_bf16(tokenizer, batch):
    model = build_tiny_gptj(tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = token_loss_sum(model, batch)
        reference = plain_token_loss_sum(model, batch)
    assert value.dtype == torch.float32
    assert relative_error(value.detach(), reference.detach()) <= 1e-3


def test_heads_that_change_the_logits_keep_the_plain_path(tokenizer):
    from gpt4all_training.model.lora import apply_lora

    model = build_tiny_gptj(tokenizer)
    model.config.final_logit_softcapping = 30.0
    assert output_head(model) is None
    lora_on_head = apply_lora(build_tiny_gptj(tokenizer), 4, 8, 0.0, ["lm_head"], False)
    assert output_head(lora_on_head) is None


def test_the_head_comes_back_after_an_error(tokenizer):
    model = build_tiny_gptj(tokenizer)
    head = model.lm_head
    with pytest.raises(RuntimeError, match="boom"):
        with head_removed(model, "lm_head"):
            assert isinstance(model.lm_head, nn.Identity)
            raise RuntimeError("boom")
    assert model.lm_head is head
