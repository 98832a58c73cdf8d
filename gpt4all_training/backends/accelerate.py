"""Building the Accelerator, and the backend around it, for every launch: python, torchrun, accelerate launch with
DDP, DeepSpeed or FSDP2; GPU, CPU or XLA. The backend is chosen here, once."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch

from gpt4all_training.backends.backend import Backend, LaunchSettings
from gpt4all_training.backends.deepspeed import DeepSpeedBackend, deepspeed_config_source, fill_deepspeed_config
from gpt4all_training.backends.fsdp import FsdpBackend, fsdp_requested, fsdp_settings
from gpt4all_training.backends.xla import XlaBackend

MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_requested() -> bool:
    """Whether the launcher asked for DeepSpeed (`--use_deepspeed` or a DEEPSPEED accelerate config)."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")


def build_accelerator(config: LaunchSettings | None = None):
    """The Accelerator of a training run (precision, accumulation, collective timeout and the DeepSpeed config from
    `config`), or with `config` None of a run that only calls the model forward (inference): the model's own
    precision, accelerate's timeout, no DeepSpeed config to fill."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    deepspeed = config is not None and deepspeed_requested()
    process_group: dict[str, Any] = {}
    if launched_world_size() > 1 and config is not None and config.ddp_timeout_s:
        # How long a rank waits in a collective for a dead or hung peer. accelerate drops a value equal to its
        # default (600 s), which gloo would replace with 30 min; a microsecond more keeps it.
        process_group["timeout"] = timedelta(seconds=config.ddp_timeout_s, microseconds=1)
    if launched_world_size() > 1 and not torch.cuda.is_available():
        if deepspeed:
            # DeepSpeed would pick a GPU backend; gloo is the CPU one. (cpu=True would quietly turn it into DDP.)
            process_group["backend"] = "gloo"
        else:
            # Without CUDA, `accelerate launch --multi_gpu` starts independent processes, and accelerate ignores
            # FSDP; make them one gloo group (FsdpBackend shards the model itself).
            os.environ["ACCELERATE_USE_CPU"] = "true"
    # DeepSpeed's engine owns accumulation; give accelerate the same count so the two never disagree.
    accumulation = config.gradient_accumulation_steps if config is not None and deepspeed else 1
    handlers = [InitProcessGroupKwargs(**process_group)] if process_group else []
    # Inference loads its weights in its dtype and needs no autocast; None also leaves a precision set earlier in
    # this process alone.
    mixed_precision = MIXED_PRECISION[config.dtype] if config is not None else None
    release_other_precision(mixed_precision)
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers,
                              gradient_accumulation_steps=accumulation)
    if config is not None and accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed calls collectives that torch deprecates, and the warnings registry is reset often enough that
        # each would print on every step (hundreds of lines a run); nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, config,
                              accelerator.num_processes, deepspeed_config_source())
    return accelerator


def release_other_precision(mixed_precision: str | None) -> None:
    """accelerate keeps one precision per process and refuses an Accelerator that asks for another; a process that
    trains twice (check's dry run beside a run, the studio, a notebook) may ask for another. The state holding the old
    one is dropped, the process group (accelerate's PartialState) kept."""
    from accelerate.state import AcceleratorState

    if mixed_precision is not None and AcceleratorState._shared_state \
            and AcceleratorState().mixed_precision != mixed_precision:
        AcceleratorState._reset_state()


def backend_for(accelerator) -> Backend:
    """The backend of an Accelerator already built."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return DeepSpeedBackend(accelerator)
    if accelerator.device.type == "xla":
        return XlaBackend(accelerator)
    return Backend(accelerator)


def build_backend(config: LaunchSettings | None = None) -> Backend:
    """The run's backend: build_accelerator(config), then the Backend that fits it. FSDP2 is chosen by the launch,
    not the Accelerator, which enables FSDP only with CUDA."""
    if config is not None and fsdp_requested():
        settings = fsdp_settings(config)
        return FsdpBackend(build_accelerator(config), settings)
    return backend_for(build_accelerator(config))
