"""Whether a name given for a model or a dataset can only mean a local path, and the one-line refusal when such a
path does not exist (with the sibling it probably meant), so that a typo is never looked up on the Hub.

In the lowest layer: the config-reading commands, the data readers and the model loaders all ask it, before
anything slow runs.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from gpt4all_training.errors import UserError

# Endings that make a name a file path, never a Hub id.
FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".json", ".jsonl", ".parquet", ".csv", ".tsv", ".yaml", ".yml")
CLOSE_ENOUGH = 0.8  # difflib ratio above which a sibling's name is offered as "did you mean"


def looks_like_path(name: str) -> bool:
    """Whether `name` can only mean a local path: it starts with `.`, `/` or `~`, has more than one `/`, ends like a
    file, exists, or its first part is a local folder (`ckpts/run`, where a Hub id would be `org/name`)."""
    path = Path(name).expanduser()
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(FILE_SUFFIXES)
            or path.exists() or ("/" in name and path.parent.is_dir()))


def closest_sibling(path: Path) -> Path | None:
    """The entry beside `path` whose name is closest to its own, when it is close enough to be a typo."""
    parent = path.parent
    if not parent.is_dir():
        return None
    names = sorted(p.name for p in parent.iterdir())
    match = difflib.get_close_matches(path.name, names, n=1, cutoff=CLOSE_ENOUGH)
    return parent / match[0] if match else None


def missing_path(key: str, name: str, instead: str | None = None) -> UserError | None:
    """The refusal for a path-like `name` that does not exist, naming the sibling it probably meant (else what to
    give `instead`, when said); None when `name` exists or may be a Hub id."""
    path = Path(name).expanduser()
    if not looks_like_path(name) or path.exists():
        return None
    meant = closest_sibling(path)
    if meant is not None:
        return UserError(f"{key}: {name} does not exist; did you mean {meant}?")
    return UserError(f"{key}: {name} does not exist" + (f"; give {instead}" if instead else ""))


def require_dataset(name: str, key: str = "dataset_path") -> None:
    """Refuse a path-like dataset name that does not exist: the cheap check a command makes before it loads a
    tokenizer or a model."""
    if (error := missing_path(key, name)) is not None:
        raise error
