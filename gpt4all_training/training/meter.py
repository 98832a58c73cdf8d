"""Throughput and the training row: tokens per second over the steps since the last row, with evaluation and saving
kept out of the clock, and that time split between building the steps' batches and updating the model."""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Any, Iterator

import torch

from gpt4all_training.training.state import TrainState

COUNTS = ("real", "trained", "padded")  # tokens of examples, tokens with a loss, positions including padding


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak host RSS, and peak GPU memory allocated by torch on a CUDA device, in MiB."""
    peaks = {"peak_rss_mb": round(peak_rss_mb(), 1)}
    if device.type == "cuda":
        peaks["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return peaks


class ThroughputMeter:
    """Counts tokens step by step; a row every log_every optimizer steps and at the last. With nan_policy "skip" the
    rows and the summary also count the skipped steps (summed over metrics.jsonl: the run's, across resumes)."""

    def __init__(self, log_every: int, total_steps: int, steps_per_epoch: int, count_skips: bool) -> None:
        self.log_every, self.total_steps, self.steps_per_epoch = log_every, total_steps, steps_per_epoch
        self.count_skips = count_skips
        self.window = dict.fromkeys(COUNTS, 0.0)
        self.batch_seconds = 0.0  # of the window, building batches
        self.started = time.perf_counter()
        self.run = dict.fromkeys(("seconds", *COUNTS), 0.0)
        self.skipped = {"row": 0, "run": 0}  # since the last row, and in this process

    def add(self, result: dict[str, Any]) -> None:
        for key in COUNTS:
            self.window[key] += result[f"n_{key}"]
        self.skipped["row"] += result["skipped"]
        self.skipped["run"] += result["skipped"]

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluation and saving are not training: the window's clock stops while they run."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - paused

    @contextlib.contextmanager
    def building_batches(self) -> Iterator[None]:
        """The step's batches are being built: read from the data, or for an objective that samples from the model,
        generated. Timed apart from the update, since generation can take most of a step."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.batch_seconds += time.perf_counter() - began

    def row(self, result: dict[str, Any], state: TrainState, device: torch.device) -> dict[str, Any]:
        """The training row of this step (the window since the last row), then a new window."""
        seconds = time.perf_counter() - self.started
        window = self.window
        row = {"loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
               "tokens_per_s": window["real"] / seconds, "trained_tokens_per_s": window["trained"] / seconds,
               "padding_fraction": 1 - window["real"] / max(window["padded"], 1.0),
               "batch_seconds": self.batch_seconds, "update_seconds": seconds - self.batch_seconds,
               "trained_tokens": state.trained_tokens, "epoch": state.epoch(self.steps_per_epoch),
               **peak_memory(device)}
        if self.count_skips:
            row["skipped_steps"], self.skipped["row"] = self.skipped["row"], 0
        self.run["seconds"] += seconds
        for key in COUNTS:
            self.run[key] += window[key]
        self.window = dict.fromkeys(COUNTS, 0.0)
        self.batch_seconds = 0.0
        self.started = time.perf_counter()
        return row

    def totals(self) -> dict[str, float]:
        """The run's throughput over its logged windows, for the summary."""
        return {"trained_tokens_per_s": round(self.run["trained"] / max(self.run["seconds"], 1e-9), 1),
                "padding_fraction": round(1 - self.run["real"] / max(self.run["padded"], 1.0), 4)}

    def skipped_total(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped["run"]} if self.count_skips else {}
