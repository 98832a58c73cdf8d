"""The raw files clean.py reads, each as a stream of units: a record (a dict) or the drop reason of a unit that is
none, with where the unit is and, for one that holds no record, its text. A unit is what clean_report.json counts as
`lines`: a line of JSON Lines, an element of a JSON array, a row of a Parquet or CSV file. Where it is, counted from
1: the line of a JSON Lines file, the line a CSV/TSV row starts on (the header is line 1), the element of a JSON
array, the row of a Parquet file.

The kind is read from the extension: `.json` is one JSON array of records when it starts with `[`, else JSON Lines;
`.parquet` is read in batches with pyarrow; `.csv` and `.tsv` have a header row naming the fields and one record per
row, every value text; anything else (`.jsonl`, a pipe such as bash's `<(zcat data.jsonl.gz)`) is JSON Lines.
Whatever cannot be read at all (a JSON array with a syntax error, a file that is not Parquet, a CSV the csv module
rejects) is one UserError naming the file and, where it has one, the line.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gpt4all_training.data.conversations import encodable
from gpt4all_training.errors import UserError

# What a folder given to clean.py is searched for.
SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".tsv")
PARQUET_BATCH = 1024
# The csv module refuses a field over 128 KiB by default; a long answer or a code file is larger.
CSV_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)


def file_kind(path: Path) -> str:
    """"json array", "parquet", "csv", "tsv" or "jsonl"."""
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".csv", ".tsv"):
        return suffix[1:]
    if suffix == ".json" and first_byte(path) == b"[":
        return "json array"
    return "jsonl"


def first_byte(path: Path) -> bytes:
    """The first byte of the file that is not white space or a byte-order mark."""
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip(b"\xef\xbb\xbf").lstrip()
    return head[:1]


@dataclass(frozen=True)
class Unit:
    number: int  # where it is (see the module docstring)
    record: dict[str, Any] | str  # the record, or why the unit holds none
    text: str = ""  # a unit that holds no record: its text (undecodable bytes as backslash escapes)


def read_units(path: Path) -> Iterator[Unit]:
    """Every unit of the file in order."""
    kind = file_kind(path)
    if kind == "jsonl":
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                record = json_line(raw)
                yield Unit(number, record, "" if isinstance(record, dict) else
                           raw.decode("utf-8", "backslashreplace").rstrip("\r\n"))
    elif kind == "json array":
        for number, item in enumerate(json_array(path), start=1):
            yield Unit(number, item if isinstance(item, dict) else "not_an_object",
                       "" if isinstance(item, dict) else json.dumps(item, ensure_ascii=False))
    elif kind == "parquet":
        yield from (Unit(number, row) for number, row in enumerate(parquet_rows(path), start=1))
    else:
        yield from csv_rows(path, "\t" if kind == "tsv" else ",")


def json_line(raw: bytes) -> dict[str, Any] | str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    line = line.lstrip("\ufeff").rstrip("\r\n")
    if not line.strip():
        return "blank_line"
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return "invalid_json"
    return obj if isinstance(obj, dict) else "not_an_object"


def json_array(path: Path) -> list[Any]:
    try:
        # The whole array at once: no streaming JSON parser is a dependency, and such files are exports of a size
        # that fits in memory.
        items = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); re-encode the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); a .json file holds one array "
                        f"of records, or one record per line") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(items, list):
        raise UserError(f"{path}: a .json file that starts with '[' must be one array of records")
    return items


def parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:200]})") from None
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: the Parquet file is damaged ({str(exc).splitlines()[0][:200]})") from None


def csv_rows(path: Path, delimiter: str) -> Iterator[Unit]:
    """Rows under the header as dicts of text, each numbered by the line it starts on. Undecodable bytes are kept as
    surrogate escapes, so that the row holding them is dropped as invalid_utf8 and the rows around it are read."""
    csv.field_size_limit(CSV_FIELD_LIMIT)
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        lines: list[str] = []  # the lines of the row being read: a quoted field may span several

        def kept_lines() -> Iterator[str]:
            for line in f:
                lines.append(line)
                yield line

        reader = csv.reader(kept_lines(), delimiter=delimiter)
        try:
            header = next(reader, None)
            if header is None:
                return
            lines.clear()
            start = reader.line_num + 1
            for row in reader:
                text = "".join(lines).rstrip("\r\n").encode("utf-8", "surrogateescape").decode("utf-8",
                                                                                            "backslashreplace")
                lines.clear()
                if not row or not any(value.strip() for value in row):
                    yield Unit(start, "blank_line", text)
                elif len(row) != len(header):
                    yield Unit(start, "wrong_field_count", text)
                elif not all(encodable(value) for value in row):
                    yield Unit(start, "invalid_utf8", text)
                else:
                    yield Unit(start, dict(zip(header, row)))
                start = reader.line_num + 1
        except csv.Error as exc:
            raise UserError(f"{path}:{reader.line_num}: not valid CSV ({exc}); fix the line, or give the file as "
                            f"JSON Lines") from None

