"""A randomly initialized model built from a config (`init: from_config`), its vocabulary sized to the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import torch
from huggingface_hub.errors import StrictDataclassError

from gpt4all_training.errors import UserError


class ArchitectureSettings(Protocol):
    """What the architecture of a model built from a config reads (objective and model blocks)."""
    model_name: Optional[str]
    model_config: Optional[str]
    model_config_overrides: Optional[dict]
    model_revision: Optional[str]
    trust_remote_code: bool


def resolve_model_config(config: ArchitectureSettings, tokenizer):
    """`model_config` (a local folder, a model type such as 'gptj', or a Hub id; default model_name) with
    `model_config_overrides` applied, and the vocabulary and special tokens of the tokenizer."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    source = config.model_config or config.model_name
    assert source is not None  # validate() requires one of them under init from_config
    try:
        if Path(source).expanduser().is_dir():
            model_config = AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code)
        elif source in CONFIG_MAPPING:
            model_config = AutoConfig.for_model(source)
        else:
            model_config = AutoConfig.from_pretrained(source, revision=config.model_revision,
                                                      trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"model_config {source}: cannot read it ({str(exc).splitlines()[0][:200]}); give a local "
                        f"folder, a model type such as gptj or llama, or a Hub id") from None
    text = model_config.get_text_config()
    for key, value in (config.model_config_overrides or {}).items():
        if not hasattr(text, key):
            raise UserError(f"model_config_overrides: {key!r} is not a field of {type(text).__name__}")
        try:
            setattr(text, key, value)
        except (ValueError, TypeError, StrictDataclassError) as exc:  # transformers validates some fields' types
            reason = (str(exc).splitlines() or [type(exc).__name__])[-1].strip()[:200]
            raise UserError(f"model_config_overrides: {key}: {reason}") from None
    text.vocab_size = len(tokenizer)  # the vocabulary follows the tokenizer, whatever the base config said
    for kind in ("bos", "eos", "pad"):
        setattr(text, f"{kind}_token_id", getattr(tokenizer, f"{kind}_token_id"))
    return model_config


def build_model_from_config(config: ArchitectureSettings, tokenizer, dtype: torch.dtype = torch.float32):
    """A randomly initialised AutoModelForCausalLM (seeded by the caller's torch seed), in `dtype`."""
    from transformers import AutoModelForCausalLM

    model_config = resolve_model_config(config, tokenizer)
    try:
        return AutoModelForCausalLM.from_config(model_config, dtype=dtype, trust_remote_code=config.trust_remote_code)
    except (ValueError, TypeError, StrictDataclassError) as exc:  # e.g. n_head not dividing n_embd
        raise UserError(f"model_config_overrides: the model cannot be built from them "
                        f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}); fix the values") from None
