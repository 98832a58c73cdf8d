"""build_map: an inference run (and optionally a second one to compare with) to map.html, map.png and clusters.csv."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpt4all_training.analysis.map.clusters import cluster_table, named_clusters, write_clusters_csv
from gpt4all_training.analysis.map.layout import embedding_features, layout_points
from gpt4all_training.analysis.map.render import (change_scale, loss_scale, map_title, page_payload, write_html,
                                                  write_png)
from gpt4all_training.analysis.map.runs import load_run, loss_change


@dataclass
class MapResult:
    html: Path
    png: Path
    clusters_csv: Path
    n_points: int
    clusters: list[dict]


def build_map(input_path: str | Path, output: str | Path, compare: str | Path | None = None,
              n_clusters: Optional[int] = None, layout: str = "umap", seed: int = 0,
              text_chars: int = 240, png: str | Path | None = None,
              clusters_csv: str | Path | None = None) -> MapResult:
    run = load_run(input_path)
    other = load_run(compare) if compare else None
    change = loss_change(run, other) if other is not None else None

    features = embedding_features(run.embeddings, seed)
    xy = layout_points(features, layout, seed)
    labels, words = named_clusters(features, run, n_clusters, seed)
    rows = cluster_table(run, labels, words, change)
    scales = {"loss": loss_scale(run.loss)}
    if change is not None:
        scales["loss change"] = change_scale(change)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_html(page_payload(run, xy, labels, rows, scales, change, other, text_chars), output)
    png_path = Path(png) if png else output.with_suffix(".png")
    # The image shows what the page opens with: the loss change when there is one, else the loss.
    write_png(xy, scales.get("loss change", scales["loss"]), labels, png_path, map_title(run))
    csv_path = Path(clusters_csv) if clusters_csv else output.parent / "clusters.csv"
    write_clusters_csv(rows, csv_path)
    return MapResult(output, png_path, csv_path, len(run.loss), rows)
