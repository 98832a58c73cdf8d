"""Fixtures of the resume tests: a small dataset (10 steps per epoch at batch 4), its config, and the uninterrupted
reference run that every interrupted run is compared with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import write_jsonl

from .harness import explain, run_train

TOTAL_STEPS = 30  # 43 training examples // batch 4 = 10 steps per epoch, x 3 epochs


@pytest.fixture(scope="session")
def resume_data(clean_dolly, tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in next(clean_dolly.glob("*_clean.jsonl")).read_text().splitlines()]
    folder = tmp_path_factory.mktemp("resume-data")
    write_jsonl(folder / "small_clean.jsonl", rows[:48])  # 43 train + 5 validation
    return folder


@pytest.fixture(scope="session")
def resume_config(tiny_model_dir, resume_data, tmp_path_factory) -> Path:
    """fp32 on CPU, checkpoints every 4 steps (keep the last 2, and every 8th for good), validation every 5."""
    config = {"model_name": str(tiny_model_dir), "dataset_path": str(resume_data), "max_length": 64,
              "batch_size": 4, "num_epochs": 3, "val_fraction": 0.1, "lr": 1.0e-3, "warmup_steps": 3,
              "save_every": 4, "keep_last": 2, "keep_every": 8, "eval_every": 5, "seed": 7, "num_proc": 1}
    path = tmp_path_factory.mktemp("resume-config") / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def reference(resume_config, tmp_path_factory) -> Path:
    """The same 30 steps, uninterrupted."""
    output_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_train(resume_config, output_dir)
    assert result.returncode == 0, explain(result)
    return output_dir
