"""Reading records: a local JSONL file or folder, or a Hub dataset; a bad record is a UserError naming file and line.

Two ways in, for the two sizes of the question:
- one record at a time (`iter_records`): a local JSONL file line by line, a Hub dataset with `streaming=True`, so a
  corpus larger than memory is never loaded whole (raw-text streams, tokenizer training, `check`);
- a whole `datasets.Dataset` (`load_table`, `load_records`): cached and mapped in parallel (fine-tuning data, raw
  text loaded up front, inference). When datasets cannot read local JSONL, the first bad line is found by
  `iter_records`, since datasets' own error names neither file nor line.

A record's text is its `text_field`, or, when that is unset, its `text` or `content` field (CodeParrot's name).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from gpt4all_training.data.conversations import is_text, record_type_problem
from gpt4all_training.errors import UserError
from gpt4all_training.paths import require_dataset

TEXT_FIELDS = ("text", "content")
SCHEMA_ADVICE = "fix the record, or run clean.py on the raw data, which counts such records as dropped"


# ---------------------------------------------------------------- where the records are

def local_text_files(dataset_path: str) -> Optional[list[Path]]:
    """The JSONL files a local `dataset_path` names (a file, or a folder's *.jsonl sorted), or None if not local."""
    path = Path(dataset_path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = folder_files(path, "*.jsonl")
        if not files:
            raise UserError(f"dataset_path: no *.jsonl files in {path}")
        return files
    require_dataset(dataset_path)
    return None


def local_data_files(path: Path) -> list[str] | None:
    """The *_clean.jsonl files `dataset_path` names locally, or None when it is not local clean data."""
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        return [str(file) for file in folder_files(path, "*_clean.jsonl")] or None
    return None


def folder_files(folder: Path, pattern: str) -> list[Path]:
    """The files in `folder` that match `pattern`, sorted, hidden ones (macOS's ._x_clean.jsonl) left out; a folder
    that matches it is a UserError rather than a file to open."""
    found = sorted(path for path in folder.glob(pattern) if not path.name.startswith("."))
    folders = [path for path in found if path.is_dir()]
    if folders:
        raise UserError(f"dataset_path {folder}: {folders[0].name} is a folder named like a data file; rename it or "
                        f"move it out of the dataset folder")
    return found


def cannot_load(dataset_path: str, exc: Exception) -> UserError:
    return UserError(f"dataset_path {dataset_path}: cannot load ({str(exc).splitlines()[0][:200]})")


# ---------------------------------------------------------------- one record at a time

def iter_records(dataset_path: str, revision: Optional[str] = None, split: str = "train", start: int = 0
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) pairs in stored order from record number `start` on (the ones before it are skipped without
    being parsed); `where` is `file:line` or `dataset record N` for error messages."""
    files = local_text_files(dataset_path)
    if files is not None:
        skip = start
        for file in files:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    if skip:
                        skip -= 1
                        continue
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        raise UserError(f"{file}:{number}: not UTF-8 text; re-encode the file as UTF-8") from None
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{file}:{number}: not valid JSON ({exc.msg}); fix or remove the line") \
                            from None
                    if not isinstance(record, dict):
                        raise UserError(f"{file}:{number}: expected a JSON object per line")
                    yield f"{file}:{number}", record
        return
    import datasets

    try:
        stream = datasets.load_dataset(dataset_path, revision=revision, split=split, streaming=True)
        for number, record in enumerate(stream.skip(start) if start else stream, start=start):
            yield f"{dataset_path} record {number}", record
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise cannot_load(dataset_path, exc) from None


def record_text(where: str, record: dict[str, Any], text_field: Optional[str]) -> str:
    """The record's text: `text_field`, or the first of `text`/`content` when unset."""
    names = (text_field,) if text_field else TEXT_FIELDS
    for name in names:
        if name in record:
            value = record[name]
            if value is None:
                return ""  # a null text is an empty one, as a datasets column reads it
            if not isinstance(value, str):
                raise UserError(f"{where}: field {name!r} is {type(value).__name__}, not text")
            return value
    wanted = f"field {text_field!r}" if text_field else "a 'text' or 'content' field"
    raise UserError(f"{where}: no {wanted} (fields: {', '.join(map(str, record)) or 'none'}); set text_field")


def iter_texts(dataset_path: str, revision: Optional[str] = None, text_field: Optional[str] = None,
               split: str = "train", start: int = 0) -> Iterator[str]:
    """Every record's text from record `start` on, in stored order (empty texts included: callers decide what they
    mean)."""
    for where, record in iter_records(dataset_path, revision, split, start):
        yield record_text(where, record, text_field)


def finetune_records(dataset_path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of prompt/response data: local *_clean.jsonl line by line, or a Hub dataset's rows."""
    path = Path(dataset_path).expanduser()
    files = local_data_files(path)
    if path.is_dir() and files is None:
        raise UserError(f"dataset_path {dataset_path}: no *_clean.jsonl files in the folder; run clean.py on the raw "
                        f"data first")
    if files is not None:
        for file in files:
            for where, record in iter_records(file):
                problem = record_type_problem(record)
                if problem:
                    raise UserError(f"{where}: {problem}; {SCHEMA_ADVICE}")
                yield where, record
        return
    for number, record in enumerate(load_records(dataset_path)):  # a Hub id (raises a one-line UserError)
        yield f"{dataset_path} record {number}", record


def record_sources(dataset_path: str) -> list[tuple[str, int]]:
    """(file, number of records) of each local file in the order load_records reads them (datasets skips blank
    lines, as this count does); [] for a Hub dataset."""
    sources = []
    for file in local_data_files(Path(dataset_path).expanduser()) or []:
        with open(file, "rb") as f:
            sources.append((file, sum(1 for raw in f if raw.strip())))
    return sources


def record_location(dataset_path: str, index: int) -> str:
    """Where record `index` (load_records' stable index) lies: `file:line` for local data (datasets skips blank lines,
    as this count does), else `record N of PATH`."""
    files = local_data_files(Path(dataset_path).expanduser())
    number = 0
    for file in files or []:
        with open(file, "rb") as f:
            for line, raw in enumerate(f, start=1):
                if raw.strip():
                    if number == index:
                        return f"{file}:{line}"
                    number += 1
    return f"record {index} of {dataset_path}"


def first_bad_line(files: Sequence[str]) -> str | None:
    """What is wrong with the first line of `files` that is not a JSON object of valid text, naming the file and the
    line, or None. Run only after datasets failed to read them: its own error names neither."""
    for file in files:
        try:
            for where, record in iter_records(file):
                if not all(is_text(v) for v in record.values() if isinstance(v, str)):
                    return f"{where}: text with a lone surrogate, which is not valid Unicode; run clean.py on it first"
        except UserError as exc:
            return str(exc)
    return None


# ---------------------------------------------------------------- a whole dataset

def unreadable_jsonl(dataset_path: str, files: Sequence[str] | None, exc: Exception, advice: str) -> UserError:
    """The error for JSONL that datasets could not read: the first bad line by file and line, else datasets' own."""
    bad_line = first_bad_line(files) if files else None
    if bad_line:
        return UserError(bad_line)
    cause = exc.__cause__ or exc
    return UserError(f"dataset_path {dataset_path}: unreadable JSONL ({str(cause).splitlines()[0][:200]}); {advice}")


def load_table(dataset_path: str, revision: Optional[str], files: Sequence[str] | None, advice: str):
    """`dataset_path` as one `datasets.Dataset`: the local JSONL `files`, or (None) a Hub dataset id, where
    `revision` pins the exact data, or a local dataset repository folder. `advice` ends the error for a bad line."""
    import datasets
    import pyarrow as pa
    from datasets import Features, Json

    if files is not None:
        files = [file for file in files if holds_text(Path(file))]  # datasets fails on a blank file
        if not files:
            raise UserError(f"dataset_path {dataset_path}: no records (the files are empty); run clean.py on the raw "
                            f"data and check what it kept")
    try:
        if files is None:
            return datasets.load_dataset(dataset_path, revision=revision, split="train")
        try:
            table = datasets.load_dataset("json", data_files=list(files), split="train")
        except datasets.exceptions.DatasetGenerationError:
            bad_line = first_bad_line(files)
            if bad_line:
                raise UserError(bad_line) from None
            # datasets takes the fields' types from the first 10 MB of the first file: records of another shape
            # further on (a file of conversations beside one of prompt/response pairs, messages that gain a key)
            # cannot be cast to them. Their types over every record can.
            table = datasets.load_dataset("json", data_files=list(files), features=record_features(files),
                                          split="train")
        if files is not None and "tools" in table.column_names and not isinstance(table.features["tools"], Json):
            # Tool definitions read as structs would come back with their keys in one order for every record (and a
            # template writes `tools | tojson` in that order); read as JSON, each keeps its own, as serving reads it.
            table = datasets.load_dataset("json", data_files=list(files), split="train",
                                          features=Features({**table.features, "tools": Json()}))
    except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise cannot_load(dataset_path, exc) from None
    except datasets.exceptions.DatasetGenerationError as exc:
        raise unreadable_jsonl(dataset_path, files, exc, advice) from None
    try:
        # datasets' JSON reader lets invalid UTF-8 through; it would fail only when tokenization reads that row.
        table.data.table.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise unreadable_jsonl(dataset_path, files, exc, advice) from None
    return table


def record_features(files: Sequence[str]):
    """The `datasets.Features` of every field over every record of `files` (a field a record lacks is None there):
    messages as a list of JSON values (each message keeps exactly its own keys), a field of one plain type as that
    type, anything else as JSON."""
    from datasets import Features, Json, List, Value

    plain = {frozenset({str}): "string", frozenset({bool}): "bool", frozenset({int}): "int64",
             frozenset({float}): "float64", frozenset({int, float}): "float64"}
    types: dict[str, set[type]] = {}
    for file in files:
        for where, record in iter_records(file):
            for key, value in record.items():
                if key == "messages" and value is not None and not isinstance(value, list):
                    raise UserError(f"{where}: field 'messages' is {type(value).__name__}, not a list of messages")
                types.setdefault(key, set()).add(type(value))
    features = {}
    for key, seen in types.items():
        kind = plain.get(frozenset(seen - {type(None)}))
        features[key] = List(Json()) if key == "messages" else Value(kind) if kind else Json()
    return Features(features)


def holds_text(path: Path) -> bool:
    """Whether the file has anything but whitespace (it is read only as far as the first such byte)."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            if chunk.strip():
                return True
    return False


def load_records(dataset_path: str, revision: str | None = None):
    """Fine-tuning data as a `datasets.Dataset` with prompt and response columns, or a messages column
    (conversations, possibly mixed with prompt/response rows), plus a stable `index` column."""
    path = Path(dataset_path).expanduser()
    files = local_data_files(path)
    if revision and path.exists():
        # Local data has no revisions: datasets 5.2 reads a folder's current files whatever the revision (even in
        # a git repository). Say so rather than let a pin look effective.
        warnings.warn(f"revision {revision!r} is ignored for the local path {dataset_path}", stacklevel=2)
    if files is None:
        require_dataset(dataset_path)
    ds = load_table(dataset_path, revision, files, "run clean.py on it first")
    missing = [c for c in ("prompt", "response") if c not in ds.column_names]
    if missing and "messages" not in ds.column_names:
        raise UserError(f"dataset_path {dataset_path}: records lack the field {missing[0]!r}; run clean.py first")
    if "messages" in ds.column_names:
        refuse_wrong_types(ds, dataset_path)
    if "index" in ds.column_names:  # a record's own "index" gives way to the stable one (training never reads it)
        ds = ds.remove_columns("index")
    return ds.add_column("index", list(range(len(ds))))


def refuse_wrong_types(ds, dataset_path: str) -> None:
    """One UserError, naming the file and line, for the first record whose messages hold a field of the wrong type
    (conversations.field_problem) or whose tools are malformed: a "train": "false" would otherwise be trained."""
    columns = [c for c in ("messages", "tools") if c in ds.column_names]
    number = 0
    for batch in ds.select_columns(columns).iter(batch_size=1024):
        for values in zip(*(batch[c] for c in columns)):
            problem = record_type_problem(dict(zip(columns, values)))
            if problem:
                raise UserError(f"{record_location(dataset_path, number)}: {problem}; {SCHEMA_ADVICE}")
            number += 1


def records_fingerprint(ds, columns: Sequence[str] = ("prompt", "response", "messages", "tools")) -> str:
    """SHA-256 of the records' `columns` (those present), row by row in stored order: what a resumed run compares
    to know it trains on the same data (another file of the same size is other data; a moved file is not)."""
    present = [c for c in columns if c in ds.column_names]
    digest = hashlib.sha256(json.dumps(present).encode())
    for batch in ds.select_columns(present).with_format("arrow").iter(batch_size=4096):
        for row in batch.to_pylist():
            digest.update(json.dumps(row, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass"))
            digest.update(b"\n")
    return digest.hexdigest()


def text_column(ds, dataset_path: str, text_field: Optional[str]) -> str:
    """The column of `ds` that holds the records' text: `text_field`, or the first of `text`/`content`."""
    names = (text_field,) if text_field else TEXT_FIELDS
    for name in names:
        if name in ds.column_names:
            dtype = getattr(ds.features[name], "dtype", None)
            if dtype not in ("string", "large_string"):
                raise UserError(f"dataset_path {dataset_path}: field {name!r} holds {dtype or 'non-text values'}, "
                                f"not text; set text_field")
            return name
    wanted = f"field {text_field!r}" if text_field else "a 'text' or 'content' field"
    raise UserError(f"dataset_path {dataset_path}: no {wanted} (fields: {', '.join(ds.column_names)}); set text_field")
