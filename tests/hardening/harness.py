"""Helpers of the hardening tests: training as a real subprocess (through fault_runner.py when a fault is injected),
its two-file dataset, and the error lines our CLI prints."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.files import write_jsonl
from support.launch import TRAIN_SCRIPT
from support.launch import run_train as run_script

from gpt4all_training.cli.main import main

RUNNER = Path(__file__).with_name("fault_runner.py")
STEPS = 6  # 40 examples // batch 4 = 10 steps per epoch; max_steps stops after 6


def run_train(config: Path, output_dir: Path, *overrides: str, fault: str | None = None, env: dict | None = None,
              prefix: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    """`train.py --config CONFIG output_dir=... OVERRIDES` in a fresh process; through fault_runner.py with `fault`;
    `prefix` is a command that execs the rest (e.g. one that drops a capability first)."""
    env = {**(env or {}), "FAULT": fault} if fault else env
    return run_script(config, output_dir, *overrides, script=RUNNER if fault else TRAIN_SCRIPT, prefix=prefix,
                      env=env, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """The lines our CLI printed as errors: at the start of a line, or right after a progress bar's closing bracket
    (a library's own log line that merely contains "error: " is not one)."""
    return [match.group(1) for line in stderr.replace("\r", "\n").splitlines()
            if (match := re.match(r"(?:.*\])?(error: .*)$", line))]


def one_error_line(capsys, argv: list[str], code: int = 2) -> str:
    """Run our CLI in this process with `argv`; it must exit with `code` having printed exactly one error line,
    which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code
    [line] = error_lines(capsys.readouterr().err)
    return line


def write_data(folder: Path, rows: list[dict]) -> Path:
    write_jsonl(folder / "a_clean.jsonl", rows[:20])
    write_jsonl(folder / "b_clean.jsonl", rows[20:40])
    return folder
