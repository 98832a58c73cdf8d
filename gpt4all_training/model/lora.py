"""Wrapping a model with a LoRA adapter (PEFT)."""

from __future__ import annotations

from gpt4all_training.errors import UserError

# PEFT's name for every linear layer but the output head. The default target, for every architecture: PEFT's own
# per-architecture defaults cover only some (none for Phi-3's fused qkv_proj/gate_up_proj or SmolLM3) and adapt
# q/v alone where they exist, while QLoRA, axolotl's lora_target_linear and Unsloth adapt every linear layer.
ALL_LINEAR = "all-linear"


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str] | None,
               gradient_checkpointing: bool):
    """Wrap `model` with a LoRA adapter on `target_modules`; unset means every linear layer but the output head."""
    from peft import LoraConfig, get_peft_model

    width = getattr(model.config.get_text_config(), "hidden_size", None)
    if width and r > width:
        # A rank above the model's width is no longer low-rank: the adapter would outweigh the layers it adapts.
        raise UserError(f"lora_r: {r} exceeds the model's width {width}; use at most {width} (8 to 64 is usual)")
    config = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules or ALL_LINEAR)
    if gradient_checkpointing:
        # Checkpointed blocks only recompute when their input needs grad; with frozen embeddings it would not.
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora_target_modules: {exc}") from None
