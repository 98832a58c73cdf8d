"""build_map: an inference run (and optionally a second one to compare with) to map.html, map.png and
map.clusters.csv (named after the page, beside it), saying what each stage does as it goes."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from gpt4all_training.analysis.map.clusters import cluster_table, named_clusters, write_clusters_csv
from gpt4all_training.analysis.map.layout import embedding_features, layout_points
from gpt4all_training.analysis.map.render import (change_scale, column_scale, loss_scale, map_title, page_payload,
                                                  write_html, write_png)
from gpt4all_training.analysis.map.runs import load_run, loss_change, result_path
from gpt4all_training.errors import UserError


@dataclass
class MapResult:
    html: Path
    png: Path
    clusters_csv: Path
    n_points: int
    clusters: list[dict]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(log: Callable[[str], None], what: Callable[[], str]) -> Iterator[None]:
    """One progress line per stage, once it is done, with its time: `what()` may describe the stage's result.
    Stage lines rather than a bar: the slow stages (UMAP, k-means) run inside libraries in one call each."""
    started = time.perf_counter()
    yield
    log(f"build_map: {what()} ({time.perf_counter() - started:.1f} s)")


def build_map(input_path: str | Path, output: str | Path, compare: str | Path | None = None,
              n_clusters: Optional[int] = None, layout: str = "umap", seed: int = 0,
              text_chars: int = 240, png: str | Path | None = None,
              clusters_csv: str | Path | None = None, color: Optional[str] = None,
              log: Callable[[str], None] = to_stderr) -> MapResult:
    """`color`: the numeric column (or, with `compare`, "loss change") the page opens coloured by and the PNG is
    drawn in; by default the loss change when there is one, else the loss."""
    with stage(log, lambda: f"read {len(run.loss)} points from {result_path(input_path)}"
                            + (f" and {result_path(compare)}" if compare else "")):
        run = load_run(input_path)
        other = load_run(compare) if compare else None
        change = loss_change(run, other) if other is not None else None
    scales = {"loss": loss_scale(run.loss)}
    if change is not None:
        scales["loss change"] = change_scale(change)
    scales.update((name, column_scale(name, values)) for name, values in run.numeric.items() if name not in scales)
    color = color or ("loss change" if change is not None else "loss")
    if color not in scales:
        raise UserError(f"--color {color}: {run.path} has no numeric column {color!r}; it has "
                        f"{', '.join(scales)}")

    with stage(log, lambda: f"features of {len(features)} embeddings (PCA)"):
        features = embedding_features(run.embeddings, seed)
    with stage(log, lambda: f"layout of {len(xy)} points ({layout})"):
        xy = layout_points(features, layout, seed)
    with stage(log, lambda: f"{len(rows)} clusters (k-means) and their labels"):
        labels, words = named_clusters(features, run, n_clusters, seed)
        rows = cluster_table(run, labels, words, change)

    output = Path(output)
    png_path = Path(png) if png else output.with_suffix(".png")
    # Named after the page, so that two maps written into one folder keep their own tables.
    csv_path = Path(clusters_csv) if clusters_csv else output.with_suffix(".clusters.csv")
    with stage(log, lambda: f"wrote {output}, {png_path} and {csv_path}"):
        for path in (output, png_path, csv_path):
            path.parent.mkdir(parents=True, exist_ok=True)
        write_html(page_payload(run, xy, labels, rows, scales, change, other, text_chars, color), output)
        write_png(xy, scales[color], labels, png_path, map_title(run))  # what the page opens with
        write_clusters_csv(rows, csv_path)
    return MapResult(output, png_path, csv_path, len(run.loss), rows)
