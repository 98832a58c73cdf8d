"""build_map: an inference run (and optionally a second one to compare with) to map.html, map.png and clusters.csv."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpt4all_training.analysis.map.clusters import cluster_labels, cluster_points, cluster_table, write_clusters_csv
from gpt4all_training.analysis.map.layout import embedding_features, layout_points
from gpt4all_training.analysis.map.render import page_payload, write_html, write_png
from gpt4all_training.analysis.map.runs import load_run, loss_change


@dataclass
class MapResult:
    html: Path
    png: Path
    clusters_csv: Path
    n_points: int
    clusters: list[dict]


def build_map(input_path: str | Path, output: str | Path, compare: str | Path | None = None,
              n_clusters: Optional[int] = None, layout: str = "neighbors", seed: int = 0,
              text_chars: int = 240, png: str | Path | None = None,
              clusters_csv: str | Path | None = None) -> MapResult:
    run = load_run(input_path)
    other = load_run(compare) if compare else None
    change = loss_change(run, other) if other is not None else None

    features = embedding_features(run.embeddings, seed)
    xy = layout_points(features, layout, seed)
    labels = cluster_points(features, run.loss, n_clusters, seed)
    rows = cluster_table(run, labels, cluster_labels(run.prompt.to_pylist(), labels), change)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_html(page_payload(run, xy, labels, rows, change, other, text_chars), output)
    png_path = Path(png) if png else output.with_suffix(".png")
    write_png(xy, run.loss, change, png_path)
    csv_path = Path(clusters_csv) if clusters_csv else output.parent / "clusters.csv"
    write_clusters_csv(rows, csv_path)
    return MapResult(output, png_path, csv_path, len(run.loss), rows)
