"""Wrapping a model with a LoRA adapter (PEFT), and the adapter's fused forward and backward."""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as PeftLoraLinear
from torch import nn

from gpt4all_training.errors import UserError

# PEFT's name for every linear layer but the output head. The default target, for every architecture: PEFT's own
# per-architecture defaults cover only some (none for Phi-3's fused qkv_proj/gate_up_proj or SmolLM3) and adapt
# q/v alone where they exist, while QLoRA, axolotl's lora_target_linear and Unsloth adapt every linear layer.
ALL_LINEAR = "all-linear"


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str] | None,
               gradient_checkpointing: bool, fused: bool = True):
    """Wrap `model` with a LoRA adapter on `target_modules`; unset means every linear layer but the output head.
    `fused`: in FusedLoraLinear layers where they apply (the backend's `fuses_lora`), else PEFT's own."""
    from peft import LoraConfig, get_peft_model

    width = getattr(model.config.get_text_config(), "hidden_size", None)
    if width and r > width:
        # A rank above the model's width is no longer low-rank: the adapter would outweigh the layers it adapts.
        raise UserError(f"lora_r: {r} exceeds the model's width {width}; use at most {width} (8 to 64 is usual)")
    config = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules or ALL_LINEAR)
    if fused and not getattr(model, "is_quantized", False):
        # bitsandbytes' quantized layers are nn.Linear subclasses: they keep PEFT's own layers for them.
        config._register_custom_module({nn.Linear: FusedLoraLinear})
    if gradient_checkpointing:
        # Checkpointed blocks only recompute when their input needs grad; with frozen embeddings it would not.
        model.enable_input_require_grads()
    try:
        adapted = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora_target_modules: {exc}") from None
    if fused and not getattr(model, "is_quantized", False):
        fuse_gated_mlps(adapted)
    return adapted


class FusedLoraLinear(PeftLoraLinear):
    """PEFT's LoRA linear layer (same parameters, same saved adapter, same merge) whose training forward and backward
    are one autograd node: the low-rank product accumulates into the base product's output inside its GEMM, scaled
    there, and the input gradients of the base and the adapter accumulate into one tensor. PEFT's path allocates
    and passes over the layer's whole output three more times (the adapter's product, its scaling, the sum) and its
    input gradient twice more, for a product of rank r. Anything the fused node does not cover (several or disabled
    adapters, a merged or quantized base, DoRA and other variants, a trained base weight) takes PEFT's path."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fusable_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base, lora_a, lora_b = self.base_layer, self.lora_A[adapter], self.lora_B[adapter]
        assert isinstance(base, nn.Linear) and isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)
        dropout = self.lora_dropout[adapter]
        p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
        return fused_lora_linear(x, base.weight, base.bias, lora_a.weight, lora_b.weight, self.scaling[adapter], p)

    def _fusable_adapter(self, args: tuple, kwargs: dict) -> str | None:
        if args or kwargs or self.disable_adapters or self.merged or type(self.base_layer) is not nn.Linear:
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant or self.fan_in_fan_out:
            return None
        base = self.base_layer
        if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return None
        return active[0]


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, scaling: float, dropout: float) -> torch.Tensor:
    """x W^T + b + scaling * dropout(x) A^T B^T, with W and b frozen, as one autograd node. Under autocast every
    product runs in autocast's dtype, as PEFT's layers do there."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight, lora_a, lora_b = (t.to(dtype) for t in (x, weight, lora_a, lora_b))
        bias = None if bias is None else bias.to(dtype)
    else:
        dtype = weight.dtype
        x, lora_a, lora_b = (t.to(dtype) for t in (x, lora_a, lora_b))
    with torch.autocast(device, enabled=False):
        return _FusedLoraLinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling, dropout)


class _FusedLoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, dropout):
        rows = x.reshape(-1, x.shape[-1])
        # Only the adapter's input is saved: the frozen base's input gradient needs its weight alone.
        keep = None
        adapter_input = rows
        if dropout > 0:
            # Drawn as torch's own dropout draws it (a Bernoulli tensor of the input's shape and dtype), so a seeded
            # run drops what PEFT's nn.Dropout would.
            keep = torch.empty_like(rows).bernoulli_(1 - dropout)
            adapter_input = rows * keep * (1 / (1 - dropout))
            keep = keep.bool()
        low_rank = adapter_input @ lora_a.t()
        out = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
        out.addmm_(low_rank, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(adapter_input, low_rank, weight, lora_a, lora_b, keep)
        ctx.scaling, ctx.dropout, ctx.input_shape = scaling, dropout, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        adapter_input, low_rank, weight, lora_a, lora_b, keep = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_low_rank = (grad_rows @ lora_b).mul_(ctx.scaling)
        grad_b = (grad_rows.t() @ low_rank).mul_(ctx.scaling)
        grad_a = grad_low_rank.t() @ adapter_input
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_rows @ weight
            if keep is not None:
                grad_x.add_((grad_low_rank @ lora_a).mul_(keep).mul_(1 / (1 - ctx.dropout)))
            else:
                grad_x.addmm_(grad_low_rank, lora_a)
            grad_x = grad_x.view(ctx.input_shape)
        return grad_x, None, None, grad_a, grad_b, None, None


def fuse_gated_mlps(model) -> int:
    """Run each gated MLP, `down(act(gate(x)) * up(x))` with SiLU (Llama, Mistral, Qwen and their kin), whose down
    projection is a FusedLoraLinear through one autograd node for the activation, the product and the down
    projection. It keeps gate and up for the backward pass and recomputes silu(gate) * up there; autograd would also
    keep silu(gate) and the product, two more tensors of the MLP's width for every token of every layer. A module
    is switched only where its own forward gives what the fused one gives on a probe input (weights on the meta
    device, as the plan builds them, are left alone). Returns how many were switched."""
    switched = 0
    for module in model.modules():
        down = getattr(module, "down_proj", None)
        if not (isinstance(down, FusedLoraLinear) and all(hasattr(module, a) for a in ("gate_proj", "up_proj",
                                                                                      "act_fn"))):
            continue
        base = down.base_layer
        assert isinstance(base, nn.Linear)  # FusedLoraLinear replaces nn.Linear layers only
        weight = base.weight  # (MLP input width, MLP width)
        if weight.is_meta:
            continue
        # Drawn from a generator of its own: building a model must not move the seeded global stream.
        probe = torch.randn(1, 2, weight.shape[0], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
        probe = probe.to(weight.device)
        fused = gated_mlp_forward.__get__(module)
        with torch.no_grad():
            if not torch.allclose(module(probe), fused(probe), rtol=1e-4, atol=1e-6):
                continue
        module.forward = fused
        switched += 1
    return switched


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward through `_GatedDownFunction` where its down projection's fused node applies, else its
    class's own (a disabled or merged adapter, dropout, an adapter merged and unloaded)."""
    down = self.down_proj
    adapter = down._fusable_adapter((), {}) if isinstance(down, FusedLoraLinear) else None
    dropout = down.lora_dropout[adapter] if adapter is not None else None
    if adapter is None or (isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0):
        return type(self).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    weight, bias = down.base_layer.weight, down.base_layer.bias
    lora_a, lora_b = down.lora_A[adapter].weight, down.lora_B[adapter].weight
    device = gate.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        gate, up, weight, lora_a, lora_b = (t.to(dtype) for t in (gate, up, weight, lora_a, lora_b))
        bias = None if bias is None else bias.to(dtype)
    else:
        gate, up, lora_a, lora_b = (t.to(weight.dtype) for t in (gate, up, lora_a, lora_b))
    with torch.autocast(device, enabled=False):
        return _GatedDownFunction.apply(gate, up, weight, bias, lora_a, lora_b, down.scaling[adapter])


class _GatedDownFunction(torch.autograd.Function):
    """down(silu(gate) * up), down a frozen linear layer plus its adapter: `_FusedLoraLinearFunction` with its input
    recomputed from gate and up in the backward pass instead of kept."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scaling):
        rows = (torch.nn.functional.silu(gate) * up).reshape(-1, gate.shape[-1])
        low_rank = rows @ lora_a.t()
        out = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
        out.addmm_(low_rank, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(gate, up, low_rank, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return out.view(*gate.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, low_rank, weight, lora_a, lora_b = ctx.saved_tensors
        activated = torch.nn.functional.silu(gate)
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_low_rank = (grad_rows @ lora_b).mul_(ctx.scaling)
        grad_b = (grad_rows.t() @ low_rank).mul_(ctx.scaling)
        grad_a = grad_low_rank.t() @ (activated * up).reshape(-1, gate.shape[-1])
        grad_product = (grad_rows @ weight).addmm_(grad_low_rank, lora_a).view(gate.shape)
        grad_up = grad_product * activated
        grad_gate = torch.ops.aten.silu_backward(grad_product.mul_(up), gate)
        return grad_gate, grad_up, None, None, grad_a, grad_b, None
