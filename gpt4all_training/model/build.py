"""The one place that assembles the model a run trains.

`build_training_model(config, tokenizer, backend, dropout_off=...)` is the model an objective trains, built in two
steps that each have a function here:

1. `base_model`: model_name's weights, or random ones from model_config (init: from_config), stored in `dtype`
   (fp32: the master weights that autocast computes from), with dropout off where the objective asks.
2. `assemble`: gradient checkpointing, the LoRA adapter, whether the loss may chunk the output head (the backend
   says), and the parameter counts, logged.

The storage choices still to come plug in here, each as a piece of its own, with the loop and the objectives
untouched: a frozen base in the compute dtype under LoRA is `base_model(..., dtype=torch.bfloat16)`, PEFT keeping
the adapter (and so its optimizer state) in fp32 (tests/test_build.py holds it to that); a quantized base passes a
bitsandbytes config through `base_model` to from_pretrained, prepares it for k-bit training (PEFT) before the
adapter in `assemble`, and is refused where `backend.partitions_parameters and not backend.shards_quantized_base`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.model.from_config import build_model_from_config, resolve_model_config
from gpt4all_training.model.loading import check_positions, load_model, model_config
from gpt4all_training.model.lora import apply_lora
from gpt4all_training.model.parameters import count_parameters, resident_parameters
from gpt4all_training.model.wrappers import unwrap_model

# The weights training updates are kept in fp32 whatever the compute dtype: autocast runs the matmuls in it.
MASTER_DTYPE = torch.float32


class BuildingBackend(Protocol):
    """What building asks the run's backend (backends/backend.py)."""
    chunks_output_head: bool

    def parameter_shape(self, param: torch.Tensor) -> torch.Size: ...

    def held_elements(self, param: torch.Tensor) -> int: ...

    def print(self, *args) -> None: ...


def build_training_model(config: TrainConfig, tokenizer, backend: BuildingBackend, *,
                         dropout_off: bool = False) -> nn.Module:
    """The model `config` trains, for backend.prepare: its base (init: config.init), checkpointed and with a LoRA
    adapter as the config says. `dropout_off` sets every dropout of the base to 0 (dpo: the policy and its reference
    must score a text alike). Under ZeRO-3 it is built partitioned."""
    return assemble(base_model(config, tokenizer, dropout_off=dropout_off), config, backend)


def base_model(config: TrainConfig, tokenizer, *, dtype: torch.dtype = MASTER_DTYPE,
               dropout_off: bool = False) -> nn.Module:
    """model_name's weights (init: pretrained) or random ones from model_config seeded by the caller's torch seed
    (init: from_config, its vocabulary the tokenizer's), stored in `dtype`."""
    if config.init == "from_config":
        model = build_model_from_config(config, tokenizer, dtype)
    else:
        assert config.model_name is not None  # init pretrained requires it
        model = load_model(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code,
                           dtype)
    if dropout_off:
        disable_dropout(model)
    return model


def assemble(model: nn.Module, config: TrainConfig, backend: BuildingBackend) -> nn.Module:
    """`model` (a base) made into the model a run trains: checkpointed, with its LoRA adapter, the loss told what it
    may do with the output head, and its parameter counts logged."""
    if config.gradient_checkpointing and not model.is_activation_checkpointing:
        model.activation_checkpointing_enable()  # type: ignore[operator]  # torch: an attribute is Tensor | Module
        # The cache is built during the forward that checkpointing recomputes.
        model.config.use_cache = False  # type: ignore[union-attr]  # torch types it as Tensor | Module
    if config.lora:
        model = apply_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules,
                           config.gradient_checkpointing)
    allow_chunked_head(model, backend.chunks_output_head)
    log_parameter_counts(model, backend)
    return model


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


def architecture(config: TrainConfig, tokenizer):
    """The config of the model to train, without its weights: built from model_config, or model_name's."""
    if config.init == "from_config":
        return resolve_model_config(config, tokenizer)
    assert config.model_name is not None  # init pretrained requires it
    return model_config(config.model_name, config.model_revision, config.gguf_file, config.trust_remote_code)


def check_max_length(config: TrainConfig, tokenizer) -> None:
    """Refuse a max_length beyond the positions of the model to train, from its config alone: before the minutes of
    tokenizing."""
    check_positions(architecture(config, tokenizer), config.max_length)
