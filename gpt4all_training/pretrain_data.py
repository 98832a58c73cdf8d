"""Raw text for tokenizer training and pretraining: records streamed from local JSONL or a Hub dataset.

Records are read one at a time (a local file line by line, a Hub dataset with `streaming=True`), so a corpus larger
than memory is never loaded whole. A record's text is its `text_field`, or, when that is unset, its `text` or
`content` field (the names most raw-text datasets use, CodeParrot's among them). A bad record is a UserError that
names the file and line, or the record number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

from .errors import UserError

TEXT_FIELDS = ("text", "content")


def local_text_files(dataset_path: str) -> Optional[list[Path]]:
    """The JSONL files a local `dataset_path` names (a file, or a folder's *.jsonl sorted), or None if not local."""
    path = Path(dataset_path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise UserError(f"dataset_path: no *.jsonl files in {path}")
        return files
    if path.suffix in (".jsonl", ".json") or dataset_path.startswith((".", "/", "~")):
        raise UserError(f"dataset_path: {dataset_path} does not exist")
    return None


def iter_records(dataset_path: str, revision: Optional[str] = None, split: str = "train"
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) pairs in stored order; `where` is `file:line` or `dataset record N` for error messages."""
    files = local_text_files(dataset_path)
    if files is not None:
        for file in files:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        raise UserError(f"{file}:{number}: not UTF-8 text; re-encode the file as UTF-8") from None
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{file}:{number}: not valid JSON ({exc.msg}); fix or remove the line") from None
                    if not isinstance(record, dict):
                        raise UserError(f"{file}:{number}: expected a JSON object per line")
                    yield f"{file}:{number}", record
        return
    import datasets

    try:
        stream = datasets.load_dataset(dataset_path, revision=revision, split=split, streaming=True)
        for number, record in enumerate(stream):
            yield f"{dataset_path} record {number}", record
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise UserError(f"dataset_path {dataset_path}: cannot load ({str(exc).splitlines()[0][:200]})") from None


def record_text(where: str, record: dict[str, Any], text_field: Optional[str]) -> str:
    """The record's text: `text_field`, or the first of `text`/`content` when unset."""
    names = (text_field,) if text_field else TEXT_FIELDS
    for name in names:
        if name in record:
            value = record[name]
            if not isinstance(value, str):
                raise UserError(f"{where}: field {name!r} is {type(value).__name__}, not text")
            return value
    wanted = f"field {text_field!r}" if text_field else "a 'text' or 'content' field"
    raise UserError(f"{where}: no {wanted} (fields: {', '.join(map(str, record)) or 'none'}); set text_field")


def iter_texts(dataset_path: str, revision: Optional[str] = None, text_field: Optional[str] = None,
               split: str = "train") -> Iterator[str]:
    """Every record's text, in stored order (empty texts included: callers decide what they mean)."""
    for where, record in iter_records(dataset_path, revision, split):
        yield record_text(where, record, text_field)
