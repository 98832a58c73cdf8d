"""Fixtures of the hardening tests: a two-file dataset, a 6-step config, the uninterrupted reference run, and a
launcher for training as real subprocesses (through fault_runner.py when a fault is injected)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, REPO, write_jsonl
from resume.harness import explain

RUNNER = Path(__file__).with_name("fault_runner.py")
STEPS = 6  # 40 examples // batch 4 = 10 steps per epoch; max_steps stops after 6


def run_train(config: Path, output_dir: Path, *overrides: str, fault: str | None = None, env: dict | None = None,
              prefix: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    """`train.py --config CONFIG output_dir=... OVERRIDES` in a fresh process; through fault_runner.py with `fault`;
    `prefix` is a command that execs the rest (e.g. one that drops a capability first)."""
    script = str(RUNNER if fault else REPO / "train.py")
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    if fault:
        full_env["FAULT"] = fault
    return subprocess.run([*prefix, PYTHON, script, "--config", str(config), f"output_dir={output_dir}", *overrides],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """The lines our CLI printed as errors: at the start of a line, or right after a progress bar's closing bracket
    (a library's own log line that merely contains "error: " is not one)."""
    return [match.group(1) for line in stderr.replace("\r", "\n").splitlines()
            if (match := re.match(r"(?:.*\])?(error: .*)$", line))]


def write_data(folder: Path, rows: list[dict]) -> Path:
    write_jsonl(folder / "a_clean.jsonl", rows[:20])
    write_jsonl(folder / "b_clean.jsonl", rows[20:40])
    return folder


@pytest.fixture(scope="session")
def dolly_rows(clean_dolly) -> list[dict]:
    return [json.loads(line) for line in next(clean_dolly.glob("*_clean.jsonl")).read_text().splitlines()][:40]


@pytest.fixture(scope="session")
def hard_data(dolly_rows, tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("hard-data"), dolly_rows)


@pytest.fixture(scope="session")
def hard_config(tiny_model_dir, hard_data, tmp_path_factory) -> Path:
    """fp32, batch 4, 6 steps of a cosine schedule from lr 1e-3 to 1e-4, no validation, no checkpoints by default."""
    config = {"model_name": str(tiny_model_dir), "dataset_path": str(hard_data), "max_length": 64,
              "batch_size": 4, "max_steps": STEPS, "val_fraction": 0.0, "lr": 1.0e-3, "min_lr": 1.0e-4,
              "warmup_steps": 0, "eval_every": None, "save_every": None, "seed": 3, "num_proc": 1,
              "report_to": ["jsonl"]}
    path = tmp_path_factory.mktemp("hard-config") / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def reference(hard_config, tmp_path_factory) -> Path:
    """The 6 steps, uninterrupted."""
    output_dir = tmp_path_factory.mktemp("hard-reference") / "run"
    result = run_train(hard_config, output_dir)
    assert result.returncode == 0, explain(result)
    return output_dir


@pytest.fixture(scope="session")
def nan_stopped(hard_config, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """NaN injected at step 4 under the default nan_policy (stop), with a checkpoint every 2 steps."""
    output_dir = tmp_path_factory.mktemp("hard-nan-stop") / "run"
    return run_train(hard_config, output_dir, "save_every=2", fault="nan_loss:4"), output_dir
