"""Fixtures of the resume tests: a small dataset (10 steps per epoch at batch 4), its config, and the uninterrupted
reference run that every interrupted run is compared with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.files import write_config, write_jsonl
from support.launch import completed_run
from support.shared import shared_fixture_folder


@pytest.fixture(scope="session")
def resume_data(clean_dolly, tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in next(clean_dolly.glob("*_clean.jsonl")).read_text().splitlines()]
    # 43 train + 5 validation; in the shared folder, like the reference run trained on it
    return shared_fixture_folder(tmp_path_factory, "resume-data",
                                 lambda folder: write_jsonl(folder / "small_clean.jsonl", rows[:48]))


@pytest.fixture(scope="session")
def resume_config(tiny_model_dir, resume_data, tmp_path_factory) -> Path:
    """fp32 on CPU, checkpoints every 4 steps (keep the last 2, and every 8th for good), validation every 5."""
    return write_config(tmp_path_factory.mktemp("resume-config"), {
        "model_name": str(tiny_model_dir), "dataset_path": str(resume_data), "max_length": 64, "batch_size": 4,
        "num_epochs": 3, "val_fraction": 0.1, "lr": 1.0e-3, "warmup_steps": 3, "save_every": 4, "keep_last": 2,
        "keep_every": 8, "eval_every": 5, "seed": 7, "num_proc": 1})


@pytest.fixture(scope="session")
def reference(resume_config, tmp_path_factory) -> Path:
    """The same 30 steps (TOTAL_STEPS), uninterrupted; run once for all the test workers."""
    return shared_fixture_folder(tmp_path_factory, "resume-reference",
                                 lambda folder: completed_run(resume_config, folder / "run")) / "run"
