"""What `dtype: auto` stands for on this machine: bfloat16 where the hardware computes in it natively (a CUDA GPU
with bf16; a CPU with AMX or AVX512-BF16), float32 elsewhere. A CPU without them emulates bf16 matmuls, many times
slower than fp32, so auto never picks bf16 there. Decided before the backend is built: its precision follows."""

from __future__ import annotations

import os

import torch


def native_dtype() -> tuple[str, str]:
    """(the dtype auto resolves to here, why: the words a log line gives). The device is the one a training launch
    takes: the GPU where CUDA is available and the launcher did not ask for the CPU."""
    if os.environ.get("PJRT_DEVICE"):  # a torch_xla launch (the TPU configs say to set it)
        return "float32", "a torch_xla launch: the XLA backend is tested in fp32 only"
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bfloat16", f"{name} computes in bf16"
        return "float32", f"{name} has no native bf16"
    # torch's cpuinfo reads the instruction sets on every OS (Linux's /proc/cpuinfo calls them amx_bf16, avx512_bf16).
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
        return "bfloat16", "this CPU computes in bf16 natively (AMX or AVX512-BF16)"
    return "float32", "this CPU has no native bf16 (AMX or AVX512-BF16) and would emulate it, far slower than fp32"


def concrete_dtype(dtype: str) -> str:
    """`dtype` itself, or what auto stands for here: for estimates made before a run resolves it (plan, check)."""
    return native_dtype()[0] if dtype == "auto" else dtype
