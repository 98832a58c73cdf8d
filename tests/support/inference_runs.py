"""Writing an inference.parquet with inference.py's schema from planted values, for the map and curate tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gpt4all_training.analysis.inference import embedding_array


def write_inference_run(folder: Path, embeddings: np.ndarray, loss: np.ndarray, prompts: list[str],
                        **columns) -> Path:
    """folder/inference.parquet; `columns` may give source, response, index, split and n_tokens, and any other
    column (a score, a record field), written after the embedding."""
    n = len(loss)
    known = {
        "source": columns.pop("source", ["synthetic"] * n), "prompt": prompts,
        "response": columns.pop("response", [f"response {i}" for i in range(n)]),
        "index": columns.pop("index", np.arange(n)), "split": columns.pop("split", ["train"] * n),
        "loss": loss, "n_tokens": columns.pop("n_tokens", np.full(n, 5)), "embedding": embedding_array(embeddings)}
    table = pa.table({**known, **columns})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "inference.parquet")
    return folder
