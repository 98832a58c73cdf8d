"""Wrapping a model with a LoRA adapter (PEFT)."""

from __future__ import annotations

from gpt4all_training.errors import UserError


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str] | None,
               gradient_checkpointing: bool):
    """Wrap `model` with a LoRA adapter; unset target modules means PEFT's default for the architecture."""
    from peft import LoraConfig, get_peft_model

    width = getattr(model.config.get_text_config(), "hidden_size", None)
    if width and r > width:
        # A rank above the model's width is no longer low-rank: the adapter would outweigh the layers it adapts.
        raise UserError(f"lora_r: {r} exceeds the model's width {width}; use at most {width} (8 to 64 is usual)")
    config = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules or None)
    if gradient_checkpointing:
        # Checkpointed blocks only recompute when their input needs grad; with frozen embeddings it would not.
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora_target_modules: {exc}") from None
