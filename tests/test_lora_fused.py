"""The fused LoRA layer (model/lora.py) against PEFT's own: the same loss, the same adapter gradients and input
gradients, with and without dropout, in fp32 and under bf16 autocast; the same saved adapter; PEFT's path wherever the
fused node does not apply (a merged or disabled adapter, several adapters)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from support.models import build_tiny_llama

from gpt4all_training.model.lora import FusedLoraLinear, apply_lora, gated_mlp_forward


def adapted_pair(tokenizer, dropout: float, seed: int = 0):
    """One tiny Llama with our LoRA and one with PEFT's, the same adapter weights (B made non-zero, so that the
    adapter's product reaches the loss)."""
    ours = apply_lora(build_tiny_llama(tokenizer, seed=seed), r=4, alpha=8, dropout=dropout, target_modules=None,
                      gradient_checkpointing=False)
    theirs = get_peft_model(build_tiny_llama(tokenizer, seed=seed),
                            LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=dropout,
                                       target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for (name, ours_param), (their_name, their_param) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert name == their_name
            if "lora_" in name:
                ours_param.copy_(torch.randn(ours_param.shape, generator=generator) * 0.1)
                their_param.copy_(ours_param)
    ours.train()
    theirs.train()
    return ours, theirs


def loss_and_grads(model, ids: torch.Tensor, seed: int, autocast: bool):
    torch.manual_seed(seed)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(inputs_embeds=embeddings, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, embeddings.grad.clone()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_matches_peft_in_fp32(tokenizer, dropout):
    ours, theirs = adapted_pair(tokenizer, dropout)
    fused = [m for m in ours.modules() if isinstance(m, FusedLoraLinear)]
    assert len(fused) == 14  # 7 linear layers in each of the 2 blocks, every one fused
    assert not any(isinstance(m, FusedLoraLinear) for m in theirs.modules())
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(3))
    our_loss, our_grads, our_input_grad = loss_and_grads(ours, ids, seed=5, autocast=False)
    their_loss, their_grads, their_input_grad = loss_and_grads(theirs, ids, seed=5, autocast=False)
    assert set(our_grads) == set(their_grads) and len(our_grads) == 28  # A and B of each adapted layer, nothing else
    # Only the order of fp32 sums differs.
    assert our_loss == pytest.approx(their_loss, rel=1e-6)
    for name, grad in their_grads.items():
        assert (our_grads[name] - grad).abs().max().item() <= 1e-5 * grad.abs().max().item(), name
    assert (our_input_grad - their_input_grad).abs().max().item() <= 1e-5 * their_input_grad.abs().max().item()


def test_the_gated_mlp_keeps_gate_and_up_and_recomputes_the_product(tokenizer):
    """Every block's MLP runs through the fused gated node (the parity tests above cover its gradients): its backward
    keeps gate and up, not also silu(gate) and the product that autograd keeps, while giving the same output."""
    ours, _ = adapted_pair(tokenizer, dropout=0.0)
    mlps = [layer.mlp for layer in ours.base_model.model.model.layers]
    assert len(mlps) == 2 and all(mlp.forward.__func__ is gated_mlp_forward for mlp in mlps)
    mlp = mlps[0]
    rows, width = 24, mlp.up_proj.base_layer.out_features
    x = torch.randn(1, rows, mlp.down_proj.base_layer.out_features, generator=torch.Generator().manual_seed(6),
                    requires_grad=True)

    def saved_bytes(forward):
        saved: dict[int, int] = {}

        def keep(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = forward(x)
        return out, sum(saved.values())

    fused_out, fused_bytes = saved_bytes(mlp)
    own_out, own_bytes = saved_bytes(type(mlp).forward.__get__(mlp))
    assert torch.equal(fused_out, own_out)
    assert own_bytes - fused_bytes == 2 * rows * width * 4  # silu(gate) and the product, fp32
    # Merged and unloaded, the down projection is a plain nn.Linear again: the class's own forward runs.
    merged = ours.merge_and_unload()
    with torch.no_grad():
        assert torch.allclose(merged.model.layers[0].mlp(x), fused_out, atol=1e-5)


def test_fused_lora_under_bf16_autocast_is_as_close_to_fp32_as_peft(tokenizer):
    """Under bf16 autocast both paths round every product; the fused one (which adds the adapter's product inside
    the base's GEMM) must land no farther from the fp32 gradients than PEFT's does, within a factor for the noise."""
    ours, theirs = adapted_pair(tokenizer, dropout=0.0)
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(3))
    exact_loss, exact_grads, _ = loss_and_grads(copy.deepcopy(theirs), ids, seed=5, autocast=False)
    our_loss, our_grads, _ = loss_and_grads(ours, ids, seed=5, autocast=True)
    their_loss, their_grads, _ = loss_and_grads(theirs, ids, seed=5, autocast=True)
    assert abs(our_loss - exact_loss) <= 2 * abs(their_loss - exact_loss) + 1e-3
    our_error = sum((our_grads[n] - g).norm().item() for n, g in exact_grads.items())
    their_error = sum((their_grads[n] - g).norm().item() for n, g in exact_grads.items())
    size = sum(g.norm().item() for g in exact_grads.values())
    assert our_error <= 1.5 * their_error and their_error < 0.05 * size


def test_fused_lora_drops_what_peft_drops(tokenizer):
    """Under the same seed both layers draw the same dropout mask: a training step of each lands on the same adapter."""
    ours, theirs = adapted_pair(tokenizer, dropout=0.5)
    ids = torch.randint(0, len(tokenizer), (1, 16), generator=torch.Generator().manual_seed(4))
    _, other_seed_grads, _ = loss_and_grads(copy.deepcopy(theirs), ids, seed=10, autocast=False)
    our_loss, our_grads, _ = loss_and_grads(ours, ids, seed=9, autocast=False)
    their_loss, their_grads, _ = loss_and_grads(theirs, ids, seed=9, autocast=False)
    assert our_loss == pytest.approx(their_loss, rel=1e-6)
    for name, grad in their_grads.items():
        assert torch.allclose(our_grads[name], grad, atol=1e-6), name
    # ... where another seed's mask gives other gradients: the masks, not their absence, are what agree.
    assert not all(torch.allclose(other_seed_grads[n], g, atol=1e-6) for n, g in their_grads.items())


def test_fused_lora_saves_peft_adapter(tokenizer, tmp_path):
    """The saved adapter is PEFT's: the same files and tensors, loadable by PeftModel into PEFT's own layers."""
    from peft import PeftModel
    from safetensors.torch import load_file

    ours, theirs = adapted_pair(tokenizer, dropout=0.0)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    our_tensors = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    their_tensors = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert our_tensors.keys() == their_tensors.keys()
    assert all(torch.equal(our_tensors[k], their_tensors[k]) for k in our_tensors)
    loaded = PeftModel.from_pretrained(build_tiny_llama(tokenizer), tmp_path / "ours")
    assert any(type(m) is PeftLoraLinear for m in loaded.modules())


def test_fused_lora_falls_back_to_peft_where_it_does_not_apply(tokenizer):
    """A merged adapter, a disabled one: PEFT's own forward, whose outputs the fused layer then equals exactly."""
    ours, theirs = adapted_pair(tokenizer, dropout=0.0)
    ours.eval()
    theirs.eval()
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with ours.disable_adapter(), theirs.disable_adapter():
            assert torch.equal(ours(ids).logits, theirs(ids).logits)
        fused_logits = ours(ids).logits
        ours.merge_adapter()
        theirs.merge_adapter()
        merged = ours(ids).logits
        assert torch.equal(merged, theirs(ids).logits)
        assert torch.allclose(merged, fused_logits, atol=1e-5)
    # A backend that partitions each module's weights (ZeRO-3: `fuses_lora` False) gets PEFT's own layers.
    unfused = apply_lora(build_tiny_llama(tokenizer), 4, 8, 0.0, None, False, fused=False)
    assert not any(isinstance(m, FusedLoraLinear) for m in unfused.modules())
    assert any(type(m) is PeftLoraLinear for m in unfused.modules())
