"""Writing the inputs of a run (JSONL data, a YAML config) and reading its JSONL outputs back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from support.paths import DOLLY


def dolly_texts(limit: int | None = None) -> list[str]:
    texts = []
    with open(DOLLY, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            texts.extend([row["instruction"], row["context"], row["response"]])
    return texts[:limit] if limit else texts


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line parsed; strict, so a run that left a cut or corrupt line fails the test that reads it."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_config(folder: Path, values: dict[str, Any], name: str = "train.yaml") -> Path:
    """`values` as folder/name, the file a run is given with --config."""
    path = folder / name
    path.write_text(yaml.safe_dump(values))
    return path
