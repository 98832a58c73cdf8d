"""Pure helpers of the backends: the per-tensor checksum that compares each rank's weights with rank 0's
(backends/replicas.py), and the width buckets that keep shapes static under XLA (backends/xla.py); no launch needed."""

from __future__ import annotations

import torch

from gpt4all_training.backends.replicas import fingerprint
from gpt4all_training.backends.xla import bucket_width


def test_fingerprint_is_equal_for_equal_tensors_and_changes_with_one_bit():
    weights = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    assert fingerprint(weights) == fingerprint(weights.clone())
    flipped = weights.clone()
    flipped.view(torch.int32)[123, 7] ^= 1  # the lowest mantissa bit of one entry
    assert fingerprint(flipped) != fingerprint(weights)
    swapped = weights.clone()
    swapped[[0, 1]] = weights[[1, 0]]  # same values, other places
    assert fingerprint(swapped) != fingerprint(weights)


def test_fingerprint_of_a_large_tensor_is_the_position_weighted_sum_of_its_bits():
    """Computed in chunks of 4M entries; the result is the same as in one go."""
    weights = torch.randn(5_000_000, generator=torch.Generator().manual_seed(1))
    bits = weights.view(torch.int32).to(torch.int64)
    assert fingerprint(weights) == (bits * torch.arange(1, bits.numel() + 1)).sum()
    half = weights.bfloat16()
    assert fingerprint(half) == (half.view(torch.int16).to(torch.int64) * torch.arange(1, half.numel() + 1)).sum()


def test_bucket_width_is_the_next_power_of_two_from_64():
    assert [bucket_width(w) for w in (1, 16, 64, 65, 128, 129, 1000, 1024, 1025)] == \
        [64, 64, 64, 128, 128, 256, 1024, 1024, 2048]
