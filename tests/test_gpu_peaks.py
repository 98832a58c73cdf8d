"""bench/gpu_peaks.py: the published dense bf16 peak that bench/gpu.sh divides by beside the measured one, looked up
by the name CUDA gives the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_peaks import mfu, published_peak  # noqa: E402


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12),  # the SXM part, as torch.cuda.get_device_name() reports it
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L40S", 362e12),  # not read as an L4
    ("NVIDIA L4", 121e12),
    ("NVIDIA GeForce RTX 4090", 165e12),
])
def test_known_devices(name, peak):
    assert published_peak(name) == peak


@pytest.mark.parametrize("name", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 3090", "Tesla T4", "",
                                  None])
def test_unknown_devices_have_no_published_peak(name):
    assert published_peak(name) is None


def test_mfu_divides_by_the_published_peak():
    achieved = 355.8e12
    assert mfu(achieved, published_peak("NVIDIA H100 80GB HBM3")) == achieved / 989e12
    assert mfu(achieved, published_peak("Tesla T4")) is None
