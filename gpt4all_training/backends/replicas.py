"""Whether the ranks' copies of the model are still bit-for-bit equal (DDP, ZeRO-1/2)."""

from __future__ import annotations

from typing import Protocol

import torch


class ComparingBackend(Protocol):
    """What comparing the replicas asks the run's backend (backends/backend.py)."""
    partitions_parameters: bool

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def unwrap(self, model): ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a tensor's bits (position-weighted, wrapping): equal tensors give equal values and a
    changed bit almost surely changes it. Computed in chunks, so a large embedding is never copied whole to int64."""
    flat = tensor.detach().contiguous().flatten()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = 1 << 22
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        total += (part * torch.arange(start + 1, start + 1 + part.numel(), device=part.device)).sum()
    return total


def replica_mismatches(backend: ComparingBackend, model) -> int | None:
    """How many parameter tensors differ, bit for bit, from rank 0's copy; None where ranks hold no whole copy of
    the model (a single process, or ZeRO-3). DDP and ZeRO-1/2 keep one copy per rank and rely on identical updates
    to keep them equal; only a checksum per tensor crosses the network. A collective: every rank calls it."""
    if backend.world_size == 1 or backend.partitions_parameters:
        return None
    sums = torch.stack([fingerprint(p) for p in backend.unwrap(model).parameters()])
    per_rank = backend.gather(sums.to(backend.device)).view(backend.world_size, -1)
    return int((per_rank != per_rank[0]).any(dim=0).sum())
