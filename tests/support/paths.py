"""Where the repository, its caches, the interpreter and the shared sample data are."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
SHARED_DATA = Path(os.environ.get("GPT4ALL_SHARED_DATA", REPO.parent / "shared" / "data"))
DOLLY = SHARED_DATA / "dolly-sample.jsonl"
OASST = SHARED_DATA / "oasst-sample.jsonl"
PYTHON = sys.executable
