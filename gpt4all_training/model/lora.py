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
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora_target_modules: {exc}") from None


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
