"""Reading an inference run (`inference.parquet`) into NumPy arrays, and the loss change between two runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpt4all_training.errors import UserError

RESULT_FILE = "inference.parquet"
SPLITS = ("train", "val")
NOT_SCORES = ("index",)  # numbers that identify an example rather than measure it


@dataclass
class Run:
    """One inference run as NumPy arrays; texts stay in Arrow until they are truncated for the page."""
    path: Path
    embeddings: np.ndarray  # (n, d) float32
    loss: np.ndarray
    n_tokens: np.ndarray
    split: np.ndarray  # str
    index: np.ndarray
    source: np.ndarray  # str
    prompt: Any  # pyarrow.ChunkedArray
    response: Any
    # Every column of numbers or booleans but the index, as float64 with NaN where a value is missing: the loss,
    # n_tokens, the scores inference wrote (ifd, agreement, outlier, ...) and a record's own numeric fields.
    numeric: dict[str, np.ndarray] = field(default_factory=dict)
    model_answer: Any = None  # the model's own answers (inference's checker), when the run has them

    def keys(self, stride: int) -> np.ndarray:
        """(split, index) as one integer per row; `stride` must exceed every index of the runs compared."""
        codes = np.array([SPLITS.index(s) if s in SPLITS else len(SPLITS) for s in self.split], dtype=np.int64)
        return codes * stride + self.index


def result_path(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / RESULT_FILE
    if not path.is_file():
        raise UserError(f"--input {path}: no inference output here; run inference.py first (it writes "
                        f"output_dir/{RESULT_FILE})")
    return path


def embedding_matrix(column, file: Path | str = "embedding column") -> np.ndarray:
    """A list-of-numbers column as an (n, d) float32 array, straight from Arrow's buffers. Every row must hold d
    finite numbers: rows of other lengths would otherwise be read across each other's boundaries."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = column.combine_chunks()
    kind = values.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) or not (
            pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)):
        raise UserError(f"{file}: column 'embedding' holds {kind}, not lists of numbers; rerun inference.py")
    if values.null_count:
        row = first_row(values.is_null())
        raise UserError(f"{file}: {values.null_count} rows have no embedding (null), e.g. row {row}; rerun "
                        f"inference.py")
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    flat = values.flatten()
    if lengths[0] == 0 or (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0]) if lengths[0] else 0
        raise UserError(f"{file}: embeddings differ in length (row 0 has {lengths[0]} values, row {row} has "
                        f"{lengths[row]}); every row needs one vector of the same size: rerun inference.py")
    if flat.null_count:
        raise UserError(f"{file}: embeddings hold {flat.null_count} missing (null) values; rerun inference.py")
    matrix = flat.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(values), int(lengths[0]))
    finite = np.isfinite(matrix).all(axis=1)
    if not finite.all():
        raise UserError(f"{file}: {int((~finite).sum())} embeddings hold NaN or infinite values, e.g. row "
                        f"{int(np.flatnonzero(~finite)[0])}; the model overflowed: rerun inference.py with dtype: "
                        f"float32")
    return matrix


def first_row(mask) -> int:
    """The first row where an Arrow boolean array is true."""
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def check_columns(table, file: Path) -> None:
    """Each column read has the type inference.py writes and, but for loss (NaN where nothing was trained) and
    source, no missing values."""
    import pyarrow as pa

    text = ("text", (pa.types.is_string, pa.types.is_large_string))
    kinds = {"prompt": text, "response": text, "split": text,
             "index": ("integers", (pa.types.is_integer,)), "n_tokens": ("integers", (pa.types.is_integer,)),
             "loss": ("numbers", (pa.types.is_floating, pa.types.is_integer))}
    for name, (wanted, accepts) in kinds.items():
        column = table.column(name)
        if not any(accept(column.type) for accept in accepts):
            raise UserError(f"{file}: column {name!r} holds {column.type}, not {wanted}; is this inference.py output?")
        if name != "loss" and column.null_count:
            raise UserError(f"{file}: column {name!r} has {column.null_count} empty (null) rows, e.g. row "
                            f"{first_row(column.combine_chunks().is_null())}; rerun inference.py")


def numeric_columns(table) -> dict[str, np.ndarray]:
    """Run.numeric of an inference table, in the table's column order."""
    import pyarrow as pa

    out = {}
    for name in table.column_names:
        kind = table.schema.field(name).type
        if name in NOT_SCORES or not (pa.types.is_floating(kind) or pa.types.is_integer(kind)
                                      or pa.types.is_boolean(kind)):
            continue
        # Through float64, whose missing values Arrow gives as NaN.
        out[name] = table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)
    return out


def load_run(path: str | Path) -> Run:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = result_path(path)
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{file}: not a readable Parquet file ({(str(exc).splitlines() or [''])[0][:160]}); run "
                        f"inference.py again to write it") from None
    missing = [c for c in ("prompt", "response", "split", "index", "loss", "n_tokens", "embedding")
               if c not in table.column_names]
    if missing:
        raise UserError(f"{file}: column {missing[0]!r} is missing; is this inference.py output?")
    if table.num_rows == 0:
        raise UserError(f"{file}: no rows")
    check_columns(table, file)
    n = table.num_rows
    source = (np.asarray(table.column("source").to_pylist(), dtype=object) if "source" in table.column_names
              else np.full(n, "unknown", dtype=object))
    return Run(path=file, embeddings=embedding_matrix(table.column("embedding"), file),
               loss=table.column("loss").to_numpy().astype(np.float64),
               n_tokens=table.column("n_tokens").to_numpy().astype(np.int64),
               split=np.asarray(table.column("split").to_pylist(), dtype=object),
               index=table.column("index").to_numpy().astype(np.int64),
               source=np.array(["unknown" if s is None else str(s) for s in source], dtype=object),
               prompt=table.column("prompt"), response=table.column("response"), numeric=numeric_columns(table),
               model_answer=table.column("model_answer") if "model_answer" in table.column_names else None)


def loss_change(run: Run, other: Run) -> np.ndarray:
    """loss(run) - loss(other) per row of `run`, matched on (split, index); NaN where `other` lacks the row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    stride = int(max(run.index.max(), other.index.max())) + 1
    keys, other_keys = run.keys(stride), other.keys(stride)
    order = np.argsort(other_keys)
    slot = np.searchsorted(other_keys[order], keys)
    slot = np.minimum(slot, len(order) - 1)
    found = other_keys[order][slot] == keys
    matched = order[slot[found]]
    same = pc.equal(run.prompt.take(pa.array(np.flatnonzero(found))), other.prompt.take(pa.array(matched)))
    if not pc.all(same).as_py() and found.any():
        raise UserError(f"--compare {other.path}: rows with the same (split, index) have different prompts; "
                        f"both runs must use the same dataset_path, revision, seed and val_fraction")
    change = np.full(len(keys), np.nan)
    change[found] = run.loss[found] - other.loss[matched]
    return change
