"""Reading an inference run (`inference.parquet`) into NumPy arrays, and the loss change between two runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt4all_training.errors import UserError

RESULT_FILE = "inference.parquet"
SPLITS = ("train", "val")


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
    prompt: object  # pyarrow.ChunkedArray
    response: object

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


def embedding_matrix(column) -> np.ndarray:
    """A list-of-float column as an (n, d) float32 array, straight from Arrow's buffers."""
    values = column.combine_chunks()
    n = len(values)
    flat = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if n == 0 or flat.size % n:
        raise UserError(f"embedding column: expected one equal-length vector per row ({n} rows, {flat.size} values)")
    return flat.reshape(n, flat.size // n)


def load_run(path: str | Path) -> Run:
    import pyarrow.parquet as pq

    file = result_path(path)
    table = pq.read_table(file)
    missing = [c for c in ("prompt", "response", "split", "index", "loss", "n_tokens", "embedding")
               if c not in table.column_names]
    if missing:
        raise UserError(f"{file}: column {missing[0]!r} is missing; is this inference.py output?")
    if table.num_rows == 0:
        raise UserError(f"{file}: no rows")
    n = table.num_rows
    source = (np.asarray(table.column("source").to_pylist(), dtype=object) if "source" in table.column_names
              else np.full(n, "unknown", dtype=object))
    return Run(path=file, embeddings=embedding_matrix(table.column("embedding")),
               loss=table.column("loss").to_numpy().astype(np.float64),
               n_tokens=table.column("n_tokens").to_numpy().astype(np.int64),
               split=np.asarray(table.column("split").to_pylist(), dtype=object),
               index=table.column("index").to_numpy().astype(np.int64),
               source=np.array(["unknown" if s is None else str(s) for s in source], dtype=object),
               prompt=table.column("prompt"), response=table.column("response"))


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
