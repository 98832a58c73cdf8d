"""The one place that assembles the model a run trains.

`build_training_model(config, tokenizer, backend, dropout_off=...)` is the model an objective trains, built in two
steps that each have a function here:

1. `base_model`: model_name's weights, or random ones from model_config (init: from_config), stored in `dtype`
   (`storage_dtype`: fp32, the master weights that autocast computes from; under LoRA the frozen base in the
   compute dtype), with dropout off where the objective asks; quantized as it loads when the config says
   load_in_4bit or load_in_8bit (model/quantization.py: the bitsandbytes config, in the storage dtype the backend
   shards, computing in the run's dtype).
2. `assemble`: gradient checkpointing, the LoRA adapter, whether the loss may chunk the output head (the backend
   says), the packed rows attended example by example where the backend runs on a CPU (model/attention.py), and
   the parameter counts, logged; for a quantized base also its storage, logged, bitsandbytes' CPU
   repacking kept off, and its fingerprint, which checkpoints record so that a resume over another base is refused.

A quantized base is refused where `backend.partitions_parameters and not backend.shards_quantized_base`, and an
8-bit one wherever parameters are partitioned (int8 tensors are not sharded). The frozen base of a LoRA run stored
in the compute dtype (`storage_dtype`) plugs in here too, PEFT keeping the adapter (and so its optimizer state) in
fp32 (tests/test_build.py holds it to that).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Protocol

import torch
from torch import nn

from gpt4all_training.errors import UserError
from gpt4all_training.model.attention import attend_per_example
from gpt4all_training.model.from_config import ArchitectureSettings, build_model_from_config, resolve_model_config
from gpt4all_training.model.loading import check_positions, load_model, model_config
from gpt4all_training.model.names import resolved_name
from gpt4all_training.model.lora import apply_lora
from gpt4all_training.model.parameters import count_parameters, resident_parameters
from gpt4all_training.model.quantization import (DTYPES, base_fingerprint, bnb_config, describe_settings,
                                                 is_quantized, is_quantizing, keep_weight_layout,
                                                 quantization_settings, quantized_bytes)
from gpt4all_training.model.wrappers import unwrap_model

# The weights training updates are kept in fp32 whatever the compute dtype: autocast runs the matmuls in it.
MASTER_DTYPE = torch.float32


class ModelSettings(ArchitectureSettings, Protocol):
    """What building the trained model reads: where its weights come from (model, objective's init), how they are
    stored (dtype, quantization), trained (LoRA, compute) and fed (batches' packing)."""
    init: Literal["pretrained", "from_config"]
    gguf_file: Optional[str]
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    gradient_checkpointing: bool
    lora: bool
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: Optional[list[str]]
    load_in_4bit: bool
    load_in_8bit: bool
    bnb_4bit_quant_type: Literal["nf4", "fp4"]
    bnb_4bit_use_double_quant: bool
    packing: bool

    @property
    def quantized_key(self) -> str | None: ...


class BuildingBackend(Protocol):
    """What building asks the run's backend (backends/backend.py)."""
    chunks_output_head: bool
    fuses_lora: bool
    attends_per_example: bool
    partitions_parameters: bool
    shards_quantized_base: bool
    quantized_storage: torch.dtype
    engine_name: str
    device: torch.device

    def parameter_shape(self, param: torch.Tensor) -> torch.Size: ...

    def held_elements(self, param: torch.Tensor) -> int: ...

    def print(self, *args) -> None: ...


def build_training_model(config: ModelSettings, tokenizer, backend: BuildingBackend, *,
                         dropout_off: bool = False) -> nn.Module:
    """The model `config` trains, for backend.prepare: its base (init: config.init), checkpointed and with a LoRA
    adapter as the config says. `dropout_off` sets every dropout of the base to 0 (dpo: the policy and its reference
    must score a text alike). Under ZeRO-3 it is built partitioned."""
    quantization = quantization_for(config, backend)
    return assemble(base_model(config, tokenizer, dtype=storage_dtype(config, backend, quantization is not None),
                               dropout_off=dropout_off, quantization=quantization,
                               device=loading_device(quantization, backend)), config, backend)


def storage_dtype(config: ModelSettings, backend: BuildingBackend, quantized: bool) -> torch.dtype:
    """What the base's weights are stored in. Under LoRA with a 16-bit compute dtype the frozen base is stored in it,
    as PEFT and TRL users load it: half the weight memory, and no cast per matmul under autocast (which computes in
    that dtype from fp32 weights anyway). The weights training updates stay fp32. Not where the backend partitions
    parameters (ZeRO-3, FSDP2), whose shards take one dtype per block, nor under a quantized base (its own storage)."""
    if config.lora and config.dtype in ("bfloat16", "float16") and not backend.partitions_parameters and not quantized:
        return getattr(torch, config.dtype)
    return MASTER_DTYPE


def quantization_for(config: ModelSettings, backend: BuildingBackend):
    """The bitsandbytes config of the base (None: unquantized), in the storage the backend can shard; a combination
    that cannot work is refused in one line that says which would."""
    settings = quantization_settings(config)
    if not is_quantizing(settings):
        return None
    key = config.quantized_key
    if backend.partitions_parameters and settings["load_in_8bit"]:
        raise UserError(f"load_in_8bit: {backend.engine_name} partitions every parameter across the processes, and "
                        f"int8 weights cannot be sharded; use load_in_4bit (its storage is sharded), or a launch "
                        f"that keeps a whole base per process (one process, DDP, DeepSpeed ZeRO-1/2)")
    if backend.partitions_parameters and not backend.shards_quantized_base:
        raise UserError(f"{key}: {backend.engine_name} cannot partition a quantized base across the processes; "
                        f"use FSDP2 or DeepSpeed ZeRO-3 to shard it, or a launch that keeps a "
                        f"whole base per process (one process, DDP, DeepSpeed ZeRO-1/2)")
    return bnb_config(settings, DTYPES[config.dtype], backend.quantized_storage)


def loading_device(quantization, backend: BuildingBackend) -> torch.device | None:
    """Where a quantized base is quantized as it loads: on this process's GPU, unless the backend shards it (then on
    the CPU, from where each process keeps only its shard). None: transformers' default, the CPU."""
    if quantization is None or backend.partitions_parameters or backend.device.type != "cuda":
        return None
    return backend.device


def base_model(config: ModelSettings, tokenizer, *, dtype: torch.dtype = MASTER_DTYPE, dropout_off: bool = False,
               quantization=None, device: torch.device | None = None) -> nn.Module:
    """model_name's weights (init: pretrained) or random ones from model_config seeded by the caller's torch seed
    (init: from_config, its vocabulary the tokenizer's), stored in `dtype`; with `quantization` (a bitsandbytes
    config) its linear layers quantized as they load, on `device`."""
    if config.init == "from_config":
        model = build_model_from_config(config, tokenizer, dtype)
    else:
        assert config.model_name is not None  # init pretrained requires it
        model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                           dtype, quantization=quantization, device=device)
    if dropout_off:
        disable_dropout(model)
    return model


def assemble(model: nn.Module, config: ModelSettings, backend: BuildingBackend) -> nn.Module:
    """`model` (a base) made into the model a run trains: checkpointed, with its LoRA adapter, the loss told what it
    may do with the output head, and its parameter counts logged."""
    if config.gradient_checkpointing and not model.is_activation_checkpointing:
        model.activation_checkpointing_enable()  # type: ignore[operator]  # torch: an attribute is Tensor | Module
        # The cache is built during the forward that checkpointing recomputes.
        model.config.use_cache = False  # type: ignore[union-attr]  # torch types it as Tensor | Module
    if config.lora:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           config.gradient_checkpointing, backend.fuses_lora)
    allow_chunked_head(model, backend.chunks_output_head)
    if config.packing and backend.attends_per_example:
        attend_per_example(model)
    log_parameter_counts(model, backend)
    if is_quantized(model):
        keep_weight_layout(model)
        unwrapped: Any = unwrap_model(model)
        unwrapped.base_fingerprint = base_fingerprint(model)  # what checkpoints record
        log_quantized_storage(model, config, backend)
    return model


def recorded_base_fingerprint(model: nn.Module) -> str | None:
    """The fingerprint assemble recorded of a quantized base (None for any other model): what checkpoints keep."""
    return getattr(unwrap_model(model), "base_fingerprint", None)


def quantized_whole_copy(unwrapped: Any, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A whole CPU copy of `unwrapped` (a PEFT model over a quantized base, sharded in memory): the base rebuilt from
    its source as the run quantized it, refused unless its fingerprint is the one the run trained over, and the
    adapter's weights from the gathered `state_dict`. What merging needs where the backend shards the base."""
    from peft import get_peft_model

    base = unwrapped.get_base_model()
    settings = quantization_settings(base.config.quantization_config.to_dict())
    compute = base.config.quantization_config.bnb_4bit_compute_dtype
    rebuilt = load_model(resolved_name(base.name_or_path), dtype=MASTER_DTYPE, quantization=bnb_config(settings,
                                                                                                        compute))
    copy = get_peft_model(rebuilt, unwrapped.peft_config[unwrapped.active_adapter])
    keep_weight_layout(copy)
    expected, got = recorded_base_fingerprint(unwrapped), base_fingerprint(copy)
    if got != expected:
        raise UserError(f"merge_lora: the base rebuilt from {base.name_or_path} has fingerprint {got[:12]}, not the "
                        f"{(expected or 'none')[:12]} the adapter was trained over (its files changed during the "
                        f"run); the adapter in final/ is saved: merge it with `gpt4all-training export`")
    trainable = {name for name, param in copy.named_parameters() if param.requires_grad}
    missing = trainable - state_dict.keys()
    if missing:
        raise UserError(f"merge_lora: the gathered weights lack the adapter's {sorted(missing)[0]}")
    copy.load_state_dict({name: state_dict[name].cpu() for name in trainable}, strict=False)
    return copy


def log_quantized_storage(model: nn.Module, config: ModelSettings, backend: BuildingBackend) -> None:
    """One line: how the base is stored, its quantized weights' bytes (constants included) and the bits per weight
    that makes, and the unquantized rest."""
    weights, stored = quantized_bytes(model)
    frozen = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if not p.requires_grad and not hasattr(p, "quant_state") and type(p).__name__ != "Int8Params")
    backend.print(f"base: {describe_settings(quantization_settings(config))}, computing in {config.dtype}: "
                  f"{weights:,} weights in {stored / 2**20:,.1f} MiB ({8 * stored / max(weights, 1):.3f} bits per "
                  f"weight, constants included), the rest of the base {frozen / 2**20:,.1f} MiB in fp32")


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in every module, as TRL does for preference training: the policy and the reference must score a
    text alike, or the loss would not start at its reference point (ln 2 for sigmoid)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def allow_chunked_head(model: nn.Module, allowed: bool) -> None:
    """Tell the loss once, on the model it will be given, whether it may select the trained positions and project
    them through the output head in chunks (training/loss.py): the backend's to say (a partitioned head, fixed
    shapes), and every loss of a run (the objective's, validation's, a preference reference's) sees this model."""
    # torch types a module's attributes as Tensor | Module
    unwrap_model(model).chunked_head_allowed = allowed  # type: ignore[assignment]


def chunked_head_allowed(model: nn.Module) -> bool:
    """What allow_chunked_head recorded; a model built elsewhere (one process: tests, benchmarks) allows it."""
    return getattr(unwrap_model(model), "chunked_head_allowed", True)


def log_parameter_counts(model: nn.Module, backend: BuildingBackend) -> None:
    """One line: trainable and total parameters, and what this rank holds where the model was built partitioned
    (ZeRO-3; FSDP2 shards later, in prepare, and says so there). The backend says how big each parameter is."""
    trainable, total = count_parameters(model, backend.parameter_shape)
    resident = resident_parameters(model, backend.held_elements)
    backend.print(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)"
                  + (f"; partitioned as they were built: this rank holds {resident:,}"
                     if resident < total else ""))


def architecture(config: ModelSettings, tokenizer):
    """The config of the model to train, without its weights: built from model_config, or model_name's."""
    if config.init == "from_config":
        return resolve_model_config(config, tokenizer)
    assert config.model_name is not None  # init pretrained requires it
    return model_config(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code)


def check_max_length(config: ModelSettings, tokenizer, max_length: int) -> None:
    """Refuse a `max_length` beyond the positions of the model to train, from its config alone: before the minutes of
    tokenizing."""
    check_positions(architecture(config, tokenizer), max_length)
