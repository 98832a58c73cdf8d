"""The published dense bf16 tensor-core peak of known GPUs: the MFU denominator other trainers divide by (NeMo,
torchtitan, MosaicML), beside the measured matmul peak bench/gpu.sh also reports.

Figures are the vendors' dense (non-sparse) bf16 tensor numbers, half the "with sparsity" figure of the datasheets:
NVIDIA's H100 datasheet (SXM 1,979 sparse -> 989; PCIe 1,513 -> 756), H200 datasheet (1,979 -> 989), A100 datasheet
(312 dense), L40S datasheet (362.05 dense, 733 sparse), L4 datasheet (242 sparse -> 121), and the Ada Lovelace
architecture whitepaper for the GeForce RTX 4090 (165.2 FP16/BF16 tensor with FP32 accumulate, dense).
"""

from __future__ import annotations

import re

# (pattern over torch.cuda.get_device_name(), FLOP/s). The SXM H100 reports "NVIDIA H100 80GB HBM3"; the NVL
# variants of H100 and H200 have lower figures and are left unknown rather than read as SXM; "L4" is matched as a
# whole word so that L40S is not read as L4.
PUBLISHED_BF16_DENSE = [
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100 (80GB HBM3|SXM)", 989e12),
    (r"\bH200\b(?! NVL)", 989e12),
    (r"\bA100\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bRTX 4090\b", 165e12),
]


def published_peak(device_name: str | None) -> float | None:
    """The published dense bf16 peak of the GPU named `device_name` (as CUDA names it); None for a device not in
    the table (and for no device: the CPU dry run)."""
    if not device_name:
        return None
    for pattern, flops in PUBLISHED_BF16_DENSE:
        if re.search(pattern, device_name):
            return flops
    return None


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float | None) -> float | None:
    """Achieved over a peak; None where there is no peak to divide by."""
    return achieved_flops_per_s / peak_flops_per_s if peak_flops_per_s else None
