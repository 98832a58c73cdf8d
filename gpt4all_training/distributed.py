"""Building the Accelerator for every launch: python, accelerate launch (DDP or DeepSpeed) and torchrun, GPU or CPU."""

from __future__ import annotations

import os

import torch

MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_accelerator(config):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    if launched_world_size() > 1 and not torch.cuda.is_available():
        # Without CUDA, `accelerate launch --multi_gpu` would start independent processes; make them one gloo group.
        os.environ["ACCELERATE_USE_CPU"] = "true"
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(mixed_precision=MIXED_PRECISION[config.dtype], kwargs_handlers=handlers)
