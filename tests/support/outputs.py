"""Reading what a run left in its output_dir (metrics rows, step folders, final weights) and comparing two runs
exactly."""

from __future__ import annotations

from pathlib import Path

import torch
from support.files import read_jsonl
from support.models import weights


def metrics(output_dir: Path) -> list[dict]:
    return read_jsonl(output_dir / "metrics.jsonl")


def exact_rows(output_dir: Path) -> list[dict]:
    """Every logged row, less what measures the machine rather than the training (speeds, times and memory peaks):
    the losses, lr, gradient norms, token counts and validation results a resumed run must repeat bit for bit."""
    return [{k: v for k, v in row.items() if not (k.endswith(("_per_s", "_seconds")) or k.startswith("peak_"))}
            for row in metrics(output_dir)]


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def assert_bitwise_equal_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[0]}: max {max_weight_difference(a, b)}"


def assert_steps_monotone(output_dir: Path, total_steps: int) -> None:
    """Training rows for steps 1..total exactly once each, in order (no duplicates, no gaps)."""
    steps = [row["step"] for row in metrics(output_dir) if "loss" in row]
    assert steps == list(range(1, total_steps + 1))


def assert_same_run(output_dir: Path, reference: Path, total_steps: int) -> None:
    assert_steps_monotone(output_dir, total_steps)
    assert exact_rows(output_dir) == exact_rows(reference)
    assert_bitwise_equal_weights(output_dir / "final", reference / "final")


def step_dirs(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.iterdir() if p.name.startswith("step_")),
                  key=lambda name: int(name.split("_")[1].split(".")[0]))
