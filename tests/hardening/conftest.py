"""Fixtures of the hardening tests: a two-file dataset, a 6-step config, the uninterrupted reference run, and a run
stopped by an injected NaN (the runs made once for all the test workers: support/shared.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.files import write_config
from support.launch import completed_run
from support.shared import read_process, save_process, shared_fixture_folder

from .harness import STEPS, run_train, write_data


@pytest.fixture(scope="session")
def dolly_rows(clean_dolly) -> list[dict]:
    return [json.loads(line) for line in next(clean_dolly.glob("*_clean.jsonl")).read_text().splitlines()][:40]


@pytest.fixture(scope="session")
def hard_data(dolly_rows, tmp_path_factory) -> Path:
    return shared_fixture_folder(tmp_path_factory, "hard-data", lambda folder: write_data(folder, dolly_rows))


@pytest.fixture(scope="session")
def hard_config(tiny_model_dir, hard_data, tmp_path_factory) -> Path:
    """fp32, batch 4, 6 steps of a cosine schedule from lr 1e-3 to 1e-4, no validation, no checkpoints by default."""
    return write_config(tmp_path_factory.mktemp("hard-config"), {
        "model_name": str(tiny_model_dir), "dataset_path": str(hard_data), "max_length": 64, "batch_size": 4,
        "max_steps": STEPS, "val_fraction": 0.0, "lr": 1.0e-3, "min_lr": 1.0e-4, "warmup_steps": 0,
        "eval_every": None, "save_every": None, "seed": 3, "num_proc": 1, "report_to": ["jsonl"]})


@pytest.fixture(scope="session")
def reference(hard_config, tmp_path_factory) -> Path:
    """The 6 steps, uninterrupted."""
    return shared_fixture_folder(tmp_path_factory, "hard-reference",
                                 lambda folder: completed_run(hard_config, folder / "run", timeout=300)) / "run"


@pytest.fixture(scope="session")
def nan_stopped(hard_config, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """NaN injected at step 4 under the default nan_policy (stop), with a checkpoint every 2 steps."""
    def build(folder: Path) -> None:
        folder.mkdir()
        save_process(run_train(hard_config, folder / "run", "save_every=2", fault="nan_loss:4"),
                     folder / "process.json")

    folder = shared_fixture_folder(tmp_path_factory, "hard-nan-stop", build)
    return read_process(folder / "process.json"), folder / "run"


@pytest.fixture(scope="session")
def checkpointed_run(hard_config, tmp_path_factory) -> Path:
    """The 6 steps with checkpoints at steps 2 and 4 (copy it before resuming into it)."""
    return shared_fixture_folder(tmp_path_factory, "hard-checkpointed", lambda folder: completed_run(
        hard_config, folder / "run", "save_every=2", timeout=300)) / "run"
