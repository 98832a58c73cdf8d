"""Loading a model and tokenizer from a Hub id, a local folder or a GGUF file; LoRA; optimiser parameter groups."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpt4all_training.errors import UserError


def model_source(name: str, gguf_file: str | None = None) -> tuple[str, dict[str, Any]]:
    """Split `model_name` into what from_pretrained takes: a `.gguf` path becomes its folder plus `gguf_file`."""
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise UserError(f"model_name: GGUF file {name} not found")
        return str(path.parent), {"gguf_file": path.name}
    if gguf_file:
        return name, {"gguf_file": gguf_file}
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1
    if looks_local and not Path(name).expanduser().exists():
        raise UserError(f"model_name: {name} does not exist; give a local folder or a Hub id like org/name")
    return name, {}


def refusal(what: str, exc: Exception) -> UserError | None:
    """transformers' two refusals to run a stranger's code, as one line naming `what`; None for other errors."""
    if isinstance(exc, pickle.UnpicklingError):  # torch.load(weights_only=True) met a pickle that is not tensors
        return UserError(f"{what}: a .bin/pickle weights file holds objects other than tensors, and loading them "
                         f"could run code; refused. Use safetensors weights, or a file from a source you trust")
    if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
        return UserError(f"{what}: ships its own Python code (auto_map in its config); set trust_remote_code: true "
                         f"only if you have read that code and trust it")
    return None


def is_adapter_folder(name: str) -> bool:
    return (Path(name) / "adapter_config.json").is_file()


@contextlib.contextmanager
def loading_errors(what: str):
    """from_pretrained failures a user can fix become one UserError line: a missing or unreadable model, custom code
    without trust_remote_code, a pickle that would run code. Anything else is a bug and raises as it is."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"{what}: cannot load ({str(exc).splitlines()[0]})") from None
    except (ValueError, pickle.UnpicklingError) as exc:
        refused = refusal(what, exc)
        if refused is None:
            raise
        raise refused from None


def load_tokenizer(name: str, revision: str | None = None, gguf_file: str | None = None,
                   trust_remote_code: bool = False):
    """A fast tokenizer with a pad token: EOS stands in when the model has none (no new tokens are ever added)."""
    from transformers import AutoTokenizer

    source, extra = model_source(name, gguf_file)
    if is_adapter_folder(source) and not (Path(source) / "tokenizer_config.json").is_file():
        source = adapter_base(source)
    with loading_errors(f"tokenizer {name}"):
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, use_fast=True,
                                                  trust_remote_code=trust_remote_code, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_for(config):
    """The tokenizer a train, inference, generate, plan or check config names (its model's, unless tokenizer_name)."""
    return load_tokenizer(config.tokenizer_name or config.model_name, config.model_revision, config.gguf_file,
                          config.trust_remote_code)


def adapter_base(adapter_dir: str) -> str:
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return config["base_model_name_or_path"]


def load_model(name: str, revision: str | None = None, gguf_file: str | None = None,
               trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
               gradient_checkpointing: bool = False):
    """An AutoModelForCausalLM in `dtype`. An adapter folder loads as base plus adapter (a PeftModel)."""
    from transformers import AutoModelForCausalLM

    if is_adapter_folder(name):
        from peft import PeftModel

        base = load_model(adapter_base(name), revision, None, trust_remote_code, dtype, gradient_checkpointing)
        return PeftModel.from_pretrained(base, name)
    source, extra = model_source(name, gguf_file)
    # transformers 5 always builds the model empty and loads weights into it (what low_cpu_mem_usage was), and
    # under ZeRO-3 partitions each parameter as it is built, so no rank ever holds a whole fp32 copy.
    with loading_errors(f"model_name {name}"):
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype,
                                                     trust_remote_code=trust_remote_code, **extra)
    if extra.get("gguf_file"):
        # GGUF weights arrive dequantised; drop the quantisation marker so the model saves as ordinary safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        # Recorded as the base of any adapter trained on it, so the adapter folder alone finds its base again.
        model.name_or_path = str(Path(source) / extra["gguf_file"])
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str] | None,
               gradient_checkpointing: bool):
    """Wrap `model` with a LoRA adapter; unset target modules means PEFT's default for the architecture."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules or None)
    if gradient_checkpointing:
        # Checkpointed blocks only recompute when their input needs grad; with frozen embeddings it would not.
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora_target_modules: {exc}") from None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    # Under ZeRO-3 a partitioned parameter is empty here; DeepSpeed keeps its real size in ds_numel.
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return trainable, total


def resident_parameters(model: nn.Module) -> int:
    """Parameter elements this process holds: its partitions under ZeRO-3 (ds_tensor), otherwise all of them."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norm weights and embeddings are exempt (as mesh-transformer-jax and CodeParrot)."""
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        ndim = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partition is flat; ds_shape is the real one
        (no_decay if ndim < 2 or id(param) in no_decay_ids else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------- a model from a config (init: from_config)

def resolve_model_config(config, tokenizer):
    """`model_config` (a local folder, a model type such as 'gptj', or a Hub id; default model_name) with
    `model_config_overrides` applied, and the vocabulary and special tokens of the tokenizer."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    source = config.model_config or config.model_name
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
        setattr(text, key, value)
    text.vocab_size = len(tokenizer)  # the vocabulary follows the tokenizer, whatever the base config said
    for kind in ("bos", "eos", "pad"):
        setattr(text, f"{kind}_token_id", getattr(tokenizer, f"{kind}_token_id"))
    return model_config


def build_model_from_config(config, tokenizer):
    """A randomly initialised AutoModelForCausalLM (seeded by the caller's torch seed), in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(resolve_model_config(config, tokenizer), dtype=torch.float32,
                                             trust_remote_code=config.trust_remote_code)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model
