"""Ruff on the repository's Python, as `make lint` runs it (pyproject.toml [tool.ruff]): in the suite too, because it
costs a fraction of a second and CI runs `make test`. mypy stays in `make lint` alone: a cold run takes minutes."""

from __future__ import annotations

import subprocess
import sys

from support.paths import REPO

LINTED = ["gpt4all_training", "tests", "bench", "demo", "configs", "scripts", *sorted(p.name for p in REPO.glob("*.py"))]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
