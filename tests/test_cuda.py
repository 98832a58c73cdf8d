"""What training relies on from the CUDA kernels, on a tiny Llama: bf16 autocast numerics, and packed examples kept
apart by the attention kernels. bench/gpu.sh runs this file on the GPU machine; without CUDA every test skips.

The packing convention is the one data/batching.py documents (position ids that restart at every example), built
here independently so that this file does not move with the package: a packed row's logits must equal each example
run alone. The tolerance is derived from bf16 itself rather than picked:

- u = 2^-8 is bf16's unit roundoff (8 significant bits): one rounding is off by at most u, relative.
- eps is the measured bf16 error of the example run alone: the largest distance of its bf16 logits from the fp32
  logits of the same weights. A packed run uses other kernels and another summation order, so its own error is of
  the same size but not the same; two such runs can differ by up to the sum of their errors, 2 * eps.
- plus one rounding of the largest logit, u * max|logit|, so that a run whose eps happens to be tiny is not held
  to a tighter bound than one bf16 rounding.
So tolerance = 2 * eps + u * max|fp32 logit|. Attention across the boundary moves the second example's logits by
far more (the leak control below measures it), so the bound separates the two cases by a wide margin.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
BF16_UNIT = 2.0 ** -8
VOCAB = 1000
LENGTHS = (37, 53)  # not multiples of any kernel's tile, so a block edge never lines up with the boundary


def tiny_llama(attention: str, dtype: torch.dtype = torch.float32):
    """A 4-layer Llama with grouped-query attention, seeded, in eval mode on DEVICE."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    return model.to(DEVICE).eval()


def examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (n,), generator=generator).to(DEVICE) for n in LENGTHS]


def packed_inputs(parts: list[torch.Tensor], block_mask: bool) -> dict[str, torch.Tensor]:
    """One row holding every example, positions restarting at each; with `block_mask` also the 4-D boolean mask
    (True: may attend) that is causal inside an example and closed between examples."""
    inputs = {"input_ids": torch.cat(parts)[None],
              "position_ids": torch.cat([torch.arange(len(p), device=DEVICE) for p in parts])[None]}
    if block_mask:
        example = torch.cat([torch.full((len(p),), i, device=DEVICE) for i, p in enumerate(parts)])
        width = len(example)
        causal = torch.ones(width, width, dtype=torch.bool, device=DEVICE).tril()
        inputs["attention_mask"] = (causal & (example[:, None] == example[None, :]))[None, None]
    return inputs


def spans(parts: list[torch.Tensor]) -> list[slice]:
    starts = [0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()]
    return [slice(a, b) for a, b in pairwise(starts)]


@torch.no_grad()
def logits(model, **inputs) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits[0].float()


def tolerance(alone_bf16: torch.Tensor, alone_fp32: torch.Tensor) -> float:
    """2 * eps + u * max|logit| (the module docstring derives it)."""
    eps = float((alone_bf16 - alone_fp32).abs().max())
    return 2 * eps + BF16_UNIT * float(alone_fp32.abs().max())


def test_bf16_training_step_matches_fp32():
    """A forward/backward under bf16 autocast over fp32 weights (how training runs) gives a finite loss within one
    bf16 rounding of the fp32 loss (relative), and gradients that point the same way."""
    model = tiny_llama("sdpa").train()
    ids = torch.randint(VOCAB, (2, 128), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def loss_and_grads(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach().float(), torch.cat([p.grad.flatten().float() for p in model.parameters()])

    loss_fp32, grads_fp32 = loss_and_grads(False)
    loss_bf16, grads_bf16 = loss_and_grads(True)
    assert torch.isfinite(loss_bf16) and torch.isfinite(grads_bf16).all()
    assert abs(loss_bf16 - loss_fp32) <= BF16_UNIT * loss_fp32, (float(loss_bf16), float(loss_fp32))
    assert torch.nn.functional.cosine_similarity(grads_bf16, grads_fp32, dim=0) >= 0.99


@pytest.mark.parametrize("block_mask", [True, False], ids=["4d-mask", "position-ids-only"])
@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"])
def test_packed_examples_stay_apart_under_sdpa(backend: str, block_mask: bool):
    """Each SDPA kernel that takes a mask, given the block-diagonal mask (4d-mask) or left to transformers to build
    it from the restarting positions (position-ids-only, what our packed batches carry): every packed example's
    logits equal the example run alone, which uses the unmasked causal kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = tiny_llama("sdpa")
    parts = examples()
    reference = [logits(model, input_ids=p[None]) for p in parts]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        alone = [logits(model, input_ids=p[None]) for p in parts]
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                packed = logits(model, **packed_inputs(parts, block_mask))
        except RuntimeError as exc:
            pytest.skip(f"{backend} does not run this masked attention here: {str(exc).splitlines()[0]}")
        leaky = logits(model, input_ids=packed_inputs(parts, False)["input_ids"])  # one causal sequence
    for i, (span, ref, own) in enumerate(zip(spans(parts), reference, alone)):
        bound = tolerance(own, ref)
        difference = float((packed[span] - own).abs().max())
        assert difference <= bound, f"example {i}: packed differs from alone by {difference:.3g} > {bound:.3g}"
    # The control: with attention across the boundary the second example moves far past the bound, so the
    # comparison above would have seen a leak.
    second = spans(parts)[1]
    assert float((leaky[second] - alone[1]).abs().max()) > 10 * tolerance(alone[1], reference[1])


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed")
def test_packed_examples_stay_apart_under_flash_attention_varlen():
    """flash_attention_2 given restarting positions only runs its varlen kernel, one sequence per example: each
    example's logits equal the example run alone (bf16 weights: flash-attention takes no fp32)."""
    parts = examples()
    fp32 = tiny_llama("sdpa")
    flash = tiny_llama("flash_attention_2", torch.bfloat16)
    flash.load_state_dict(fp32.state_dict())
    reference = [logits(fp32, input_ids=p[None]) for p in parts]
    alone = [logits(flash, input_ids=p[None]) for p in parts]
    packed = logits(flash, **packed_inputs(parts, False))
    for i, (span, ref, own) in enumerate(zip(spans(parts), reference, alone)):
        bound = tolerance(own, ref)
        difference = float((packed[span] - own).abs().max())
        assert difference <= bound, f"example {i}: packed differs from alone by {difference:.3g} > {bound:.3g}"
