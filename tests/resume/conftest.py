"""Fixtures of the resume tests: a small dataset (10 steps per epoch at batch 4), its config, and the uninterrupted
reference run that every interrupted run is compared with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.files import write_config, write_jsonl
from support.launch import completed_run


@pytest.fixture(scope="session")
def resume_data(clean_dolly, tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in next(clean_dolly.glob("*_clean.jsonl")).read_text().splitlines()]
    folder = tmp_path_factory.mktemp("resume-data")
    write_jsonl(folder / "small_clean.jsonl", rows[:48])  # 43 train + 5 validation
    return folder


@pytest.fixture(scope="session")
def resume_config(tiny_model_dir, resume_data, tmp_path_factory) -> Path:
    """fp32 on CPU, checkpoints every 4 steps (keep the last 2, and every 8th for good), validation every 5."""
    return write_config(tmp_path_factory.mktemp("resume-config"), {
        "model_name": str(tiny_model_dir), "dataset_path": str(resume_data), "max_length": 64, "batch_size": 4,
        "num_epochs": 3, "val_fraction": 0.1, "lr": 1.0e-3, "warmup_steps": 3, "save_every": 4, "keep_last": 2,
        "keep_every": 8, "eval_every": 5, "seed": 7, "num_proc": 1})


@pytest.fixture(scope="session")
def reference(resume_config, tmp_path_factory) -> Path:
    """The same 30 steps (TOTAL_STEPS), uninterrupted."""
    return completed_run(resume_config, tmp_path_factory.mktemp("reference") / "run")
