"""A local, self-contained map of an inference run: where the model's embeddings put each example, and its loss.

`python build_map.py --input INFERENCE_DIR --output map.html [--compare OTHER_INFERENCE_DIR]` writes
- `map.html`: one file, every script and style inline, no network. Points are drawn on a canvas, so tens of
  thousands stay responsive. Colour by loss, cluster, source or split (and loss change with `--compare`); hover for
  the prompt and response; a search box highlights matches; the cluster table is sorted by mean loss, hardest
  first, which is where broken or hard data shows up. A link can carry a view:
  `map.html#colour=source&search=volcano&point=val:12` (the last opens that example's hover card).
- `map.png` (next to the HTML): the same layout coloured by loss (or by loss change), from a small PNG encoder.
- `clusters.csv`: one row per cluster with its label, size and loss statistics.

How the 2-D layout is made, and why. Embeddings are centred and scaled to unit length (cosine geometry: a few
huge hidden-state dimensions would otherwise dominate), then reduced by PCA to at most 50 dimensions. PCA's first
two components alone keep global structure but pile distinct clusters on top of each other. t-SNE separates them,
but exact t-SNE costs O(n^2) per iteration, which NumPy cannot afford at tens of thousands of points, and neither
UMAP nor scikit-learn is a dependency of this project. So the default `--layout neighbors` refines the PCA layout
with the force model UMAP and LargeVis use: each point is pulled towards its 15 nearest neighbours (found exactly,
in blocks) and pushed from a few random points, with a heavy-tailed kernel. That costs O(n k) per epoch, starts
from PCA so the global arrangement survives, and is deterministic for a seed. `--layout pca` skips the refinement.

Clusters are k-means (k-means++ start) on the same PCA features, numbered by mean loss, hardest first. A cluster's
label is its most distinctive prompt words: those whose share of the cluster's prompts most exceeds their share of
all prompts, weighted by how common they are in the cluster (each word's term of the KL divergence).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import struct
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gpt4all_training.errors import UserError

RESULT_FILE = "inference.parquet"
SPLITS = ("train", "val")
MAX_CATEGORIES = 20  # colours; rarer sources share the last one as "other"
# Colour ramps shared by the page and the PNG, bright enough for a dark background: low loss blue through green to
# high loss red; loss change blue (went down) through grey to red (went up). Red is "look here" in both.
LOSS_STOPS = [(60, 120, 216), (70, 190, 190), (140, 210, 90), (250, 200, 40), (240, 60, 50)]
CHANGE_STOPS = [(5, 113, 176), (146, 197, 222), (200, 200, 200), (244, 165, 130), (202, 0, 32)]
CATEGORY_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                    (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207), (174, 199, 232),
                    (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213), (196, 156, 148),
                    (247, 182, 210), (219, 219, 141), (158, 218, 229), (255, 255, 255), (127, 127, 127)]
BACKGROUND = (17, 17, 17)
MISSING = (90, 90, 90)
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between
both but by can could did do does doing down during each few for from further had has have having he her here
hers him his how i if in into is it its itself just me more most my no nor not now of off on once only or other
our ours out over own same she should so some such than that the their theirs them then there these they this
those through to too under until up very was we were what when where which while who whom why will with would
you your yours yourself give list tell describe explain write based using use provided following given text
please one two many much like get make know think want need way well may might must shall let
""".split())
WORD = re.compile(r"[a-z][a-z0-9]+(?:'[a-z]+)?")


# ---------------------------------------------------------------- reading an inference run

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


# ---------------------------------------------------------------- reduction and clustering (pure NumPy)

def unit_rows(x: np.ndarray) -> np.ndarray:
    """Centred rows scaled to unit length, so distances follow cosine similarity."""
    x = x.astype(np.float32) - x.mean(axis=0, dtype=np.float64).astype(np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def orthonormal_columns(y: np.ndarray) -> np.ndarray:
    """An orthonormal basis of y's column space, from the eigenvectors of the small Gram matrix (Cholesky-QR's
    idea; NumPy's Householder QR is seconds slower on tall matrices)."""
    gram = (y.T @ y).astype(np.float64)
    values, vectors = np.linalg.eigh(gram)
    keep = values > values.max() * 1e-10
    return (y @ (vectors[:, keep] / np.sqrt(values[keep])).astype(y.dtype)).astype(y.dtype)


def pca(x: np.ndarray, n_components: int, seed: int = 0) -> np.ndarray:
    """The top principal components of `x` (randomised range finder, 4 power iterations), signs fixed.
    Exact when x has at most n_components + 10 columns: the range then holds every direction."""
    x = (x - x.mean(axis=0)).astype(np.float64)
    n_components = min(n_components, *x.shape)
    if not np.any(x):  # one point, or all identical: there is no direction to find
        return np.zeros((x.shape[0], n_components), dtype=np.float32)
    width = min(x.shape[1], x.shape[0], n_components + 10)
    rng = np.random.default_rng(seed)
    basis = orthonormal_columns(x @ rng.standard_normal((x.shape[1], width)))
    for _ in range(4):
        basis = orthonormal_columns(x @ (x.T @ basis))
    _, _, vt = np.linalg.svd(basis.T @ x, full_matrices=False)
    components = vt[:n_components]
    # An SVD's signs are arbitrary; make each component's largest loading positive so layouts are repeatable.
    signs = np.sign(components[np.arange(len(components)), np.abs(components).argmax(axis=1)])
    return (x @ (components * signs[:, None]).T).astype(np.float32)


def nearest_neighbors(x: np.ndarray, k: int, block: int = 512) -> np.ndarray:
    """Indices of each row's k nearest other rows (exact squared Euclidean distance, in row blocks)."""
    squared = np.einsum("ij,ij->i", x, x)
    out = np.empty((len(x), k), dtype=np.int64)
    for start in range(0, len(x), block):
        rows = slice(start, min(start + block, len(x)))
        # |a|^2 + |b|^2 - 2ab without the |a|^2 term, constant along a row: the same ranking, one pass less.
        dist = x[rows] @ x.T
        dist *= -2.0
        dist += squared[None, :]
        dist[np.arange(dist.shape[0]), np.arange(rows.start, rows.stop)] = np.inf  # not your own neighbour
        out[rows] = np.argpartition(dist, k - 1, axis=1)[:, :k]
    return out


def neighbor_layout(features: np.ndarray, init: np.ndarray, n_neighbors: int = 15, n_epochs: int = 200,
                    negatives: int = 5, seed: int = 0) -> np.ndarray:
    """Refine a 2-D `init` so that neighbours in `features` sit together (attraction along kNN edges, repulsion
    from random points; the kernel 1/(1+d^2) of t-SNE and UMAP). Full-batch steps, shrinking linearly to 0."""
    n = len(features)
    k = min(n_neighbors, n - 1)
    y = init.astype(np.float64)
    y = (y - y.mean(axis=0)) / max(float(y.std(axis=0).max()), 1e-12) * 3.0
    if k < 1:
        return y
    neighbours = nearest_neighbors(features, k)
    edges = np.unique(np.sort(np.stack([np.repeat(np.arange(n), k), neighbours.ravel()], axis=1), axis=1), axis=0)
    head, tail = edges[:, 0], edges[:, 1]
    degree = (np.bincount(head, minlength=n) + np.bincount(tail, minlength=n)).astype(np.float64)[:, None]
    rng = np.random.default_rng(seed)
    pushed = np.repeat(np.arange(n), negatives)

    def summed(rows: np.ndarray, forces: np.ndarray) -> np.ndarray:
        return np.stack([np.bincount(rows, forces[:, 0], n), np.bincount(rows, forces[:, 1], n)], axis=1)

    for epoch in range(n_epochs):
        diff = y[head] - y[tail]
        pull = (-2.0 / (1.0 + (diff * diff).sum(axis=1)))[:, None] * diff
        force = (summed(head, pull) - summed(tail, pull)) / degree
        others = rng.integers(0, n, size=len(pushed))
        diff = y[pushed] - y[others]
        d2 = (diff * diff).sum(axis=1)
        push = np.clip((2.0 / ((0.001 + d2) * (1.0 + d2)))[:, None] * diff, -4.0, 4.0)
        force += summed(pushed, push)  # summed, not averaged: each point feels `negatives` pushes per pull
        y += (1.0 - epoch / n_epochs) * np.clip(force, -4.0, 4.0)
    return y


def kmeans(x: np.ndarray, k: int, seed: int = 0, iterations: int = 50) -> np.ndarray:
    """Cluster labels from Lloyd's algorithm with a k-means++ start; an emptied cluster takes the farthest point."""
    rng = np.random.default_rng(seed)
    x = x.astype(np.float64)
    squared = np.einsum("ij,ij->i", x, x)
    centres = [x[rng.integers(len(x))]]
    closest = np.full(len(x), np.inf)
    for _ in range(1, k):
        closest = np.minimum(closest, ((x - centres[-1]) ** 2).sum(axis=1))
        total = closest.sum()
        pick = rng.choice(len(x), p=closest / total) if total > 0 else rng.integers(len(x))
        centres.append(x[pick])
    centres = np.stack(centres)
    labels = np.full(len(x), -1)
    for _ in range(iterations):
        dist = squared[:, None] - 2.0 * x @ centres.T + np.einsum("ij,ij->i", centres, centres)[None, :]
        new_labels = dist.argmin(axis=1)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
        for c in range(k):
            members = labels == c
            if members.any():
                centres[c] = x[members].mean(axis=0)
            else:
                far = dist[np.arange(len(x)), labels].argmax()
                centres[c], labels[far] = x[far], c
    return labels


def default_cluster_count(n: int) -> int:
    return int(min(40, max(2, round(math.sqrt(n / 4))), n))


def renumber_by_loss(labels: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Cluster 0 is the one with the highest mean loss; ties by size, then old id."""
    ids = np.unique(labels)
    means = np.array([np.nanmean(loss[labels == c]) if np.isfinite(loss[labels == c]).any() else -np.inf
                      for c in ids])
    sizes = np.array([(labels == c).sum() for c in ids])
    rank = np.empty(len(ids), dtype=np.int64)
    rank[np.lexsort((ids, -sizes, -means))] = np.arange(len(ids))
    return rank[np.searchsorted(ids, labels)]


def prompt_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if w not in STOPWORDS and len(w) > 2}


def cluster_labels(prompts: list[str], labels: np.ndarray, n_words: int = 3) -> list[str]:
    """Each cluster's most distinctive prompt words: p(w|c) * log(p(w|c) / p(w)), over prompts containing w."""
    vocabulary: dict[str, int] = {}
    doc_ids, word_ids = [], []
    for doc, text in enumerate(prompts):
        for word in sorted(prompt_words(text or "")):  # sorted: ties break the same way in every process
            doc_ids.append(doc)
            word_ids.append(vocabulary.setdefault(word, len(vocabulary)))
    n_clusters = int(labels.max()) + 1
    if not vocabulary:
        return [f"cluster {c}" for c in range(n_clusters)]
    words = np.array(sorted(vocabulary, key=vocabulary.get), dtype=object)
    doc_ids, word_ids = np.asarray(doc_ids), np.asarray(word_ids)
    counts = np.zeros((n_clusters, len(words)))
    np.add.at(counts, (labels[doc_ids], word_ids), 1.0)
    sizes = np.bincount(labels, minlength=n_clusters).astype(np.float64)[:, None]
    p_in = counts / np.maximum(sizes, 1)
    p_all = counts.sum(axis=0) / len(prompts)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(counts >= min(2, len(prompts)), p_in * np.log(p_in / p_all), -np.inf)
    out = []
    for c in range(n_clusters):
        best = [i for i in np.argsort(-score[c], kind="stable")[:n_words] if np.isfinite(score[c, i])]
        out.append(", ".join(words[best]) if best else f"cluster {c}")
    return out


def normalise_layout(y: np.ndarray) -> np.ndarray:
    """Fit into [0, 1]^2 keeping the aspect ratio; the outermost 0.1% are pinned to the edge, not allowed to
    shrink everything else."""
    low, high = np.percentile(y, 0.1, axis=0), np.percentile(y, 99.9, axis=0)
    span = max(float((high - low).max()), 1e-12)
    centred = (y - (low + high) / 2) / span + 0.5
    return np.clip(centred, 0.0, 1.0)


# ---------------------------------------------------------------- colours and the PNG

def colour_range(values: np.ndarray, symmetric: bool = False) -> tuple[float, float]:
    """2nd..98th percentile of the finite values (symmetric about 0 for changes): outliers do not wash it out."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return (-1.0, 1.0) if symmetric else (0.0, 1.0)
    if symmetric:
        bound = max(float(np.percentile(np.abs(finite), 98)), 1e-6)
        return -bound, bound
    low, high = float(np.percentile(finite, 2)), float(np.percentile(finite, 98))
    return (low, high) if high > low else (low - 0.5, low + 0.5)


def ramp_colours(values: np.ndarray, value_range: tuple[float, float], stops: list[tuple]) -> np.ndarray:
    """(n, 3) uint8 colours along a piecewise-linear ramp; NaN gets the 'missing' grey."""
    stops_array = np.asarray(stops, dtype=np.float64)
    low, high = value_range
    t = np.clip((np.nan_to_num(values, nan=low) - low) / (high - low), 0.0, 1.0) * (len(stops) - 1)
    left = np.minimum(t.astype(np.int64), len(stops) - 2)
    frac = (t - left)[:, None]
    rgb = stops_array[left] * (1 - frac) + stops_array[left + 1] * frac
    rgb[~np.isfinite(values)] = MISSING
    return np.round(rgb).astype(np.uint8)


def rasterise(xy: np.ndarray, rgb: np.ndarray, order: np.ndarray, width: int = 1000, height: int = 800,
              radius: int = 1) -> np.ndarray:
    """Points as (2 radius + 1)-pixel squares on the background, drawn in `order` (later on top)."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    pad = 10 + radius
    side = min(width, height) - 2 * pad
    left, top = (width - side) // 2, (height - side) // 2
    px = np.round(left + xy[order, 0] * side).astype(np.int64)
    py = np.round(top + (1.0 - xy[order, 1]) * side).astype(np.int64)
    colours = rgb[order]
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            image[py + dy, px + dx] = colours  # later rows overwrite earlier ones: `order` decides what is on top
    return image


def encode_png(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG: signature, IHDR, one zlib IDAT of unfiltered rows, IEND."""
    height, width, _ = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


# ---------------------------------------------------------------- the map

@dataclass
class MapResult:
    html: Path
    png: Path
    clusters_csv: Path
    n_points: int
    clusters: list[dict]


def categories(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Category names by frequency (the rarest folded into 'other') and each row's code."""
    counts = Counter(values.tolist())
    names = [name for name, _ in counts.most_common()]
    if len(names) > MAX_CATEGORIES:
        names = names[:MAX_CATEGORIES - 1] + ["other"]
    lookup = {name: i for i, name in enumerate(names)}
    other = len(names) - 1
    return names, np.array([lookup.get(v, other) for v in values.tolist()], dtype=np.int64)


def truncate(column, limit: int) -> list[str]:
    """Texts cut to `limit` characters with an ellipsis; the page carries these, not the full records."""
    out = []
    for text in column.to_pylist():
        text = text or ""
        out.append(text if len(text) <= limit else text[:limit - 1] + "\u2026")
    return out


def cluster_table(run: Run, labels: np.ndarray, words: list[str], change: Optional[np.ndarray]) -> list[dict]:
    rows = []
    for c in range(int(labels.max()) + 1):
        m = labels == c
        finite = run.loss[m][np.isfinite(run.loss[m])]
        row = {"cluster": c, "label": words[c], "size": int(m.sum()),
               "mean_loss": round(float(finite.mean()), 4) if finite.size else None,
               "median_loss": round(float(np.median(finite)), 4) if finite.size else None,
               "mean_n_tokens": round(float(run.n_tokens[m].mean()), 1),
               "top_source": Counter(run.source[m].tolist()).most_common(1)[0][0],
               "train": int((run.split[m] == "train").sum()), "val": int((run.split[m] == "val").sum())}
        if change is not None:
            delta = change[m][np.isfinite(change[m])]
            row["mean_loss_change"] = round(float(delta.mean()), 4) if delta.size else None
        rows.append(row)
    return sorted(rows, key=lambda r: (-(r["mean_loss"] if r["mean_loss"] is not None else -np.inf), r["cluster"]))


def write_clusters_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def rounded(values: np.ndarray, digits: int) -> list[Optional[float]]:
    return [None if not math.isfinite(v) else v for v in np.round(values.astype(np.float64), digits).tolist()]


def page_payload(run: Run, xy: np.ndarray, labels: np.ndarray, rows: list[dict], change: Optional[np.ndarray],
                 other: Optional[Run], text_chars: int) -> dict:
    sources, source_codes = categories(run.source)
    split_names, split_codes = categories(run.split)
    payload = {
        "title": f"{run.path.parent.name or run.path.name}: {len(run.loss)} examples",
        "subtitle": str(run.path) + (f" compared with {other.path}" if other is not None else ""),
        "x": rounded(xy[:, 0], 4), "y": rounded(xy[:, 1], 4),
        "loss": rounded(run.loss, 4), "n_tokens": run.n_tokens.tolist(), "index": run.index.tolist(),
        "cluster": labels.tolist(), "source": source_codes.tolist(), "sources": sources,
        "split": split_codes.tolist(), "splits": split_names,
        "prompt": truncate(run.prompt, text_chars), "response": truncate(run.response, text_chars),
        "clusters": [{k: r[k] for k in ("cluster", "label", "size", "mean_loss", "mean_loss_change") if k in r}
                     for r in rows],
        "loss_range": colour_range(run.loss), "loss_stops": LOSS_STOPS,
        "categories": CATEGORY_COLOURS, "missing": MISSING, "background": BACKGROUND,
        "change": None,
    }
    if change is not None:
        payload.update(change=rounded(change, 4), change_range=colour_range(change, symmetric=True),
                       change_stops=CHANGE_STOPS)
    return payload


def write_html(payload: dict, path: Path) -> None:
    # "<" escaped so that no text in the data can close the <script> element it lives in.
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    page = PAGE.replace("__TITLE__", escape_html(payload["title"])).replace("__DATA__", data)
    path.write_text(page, encoding="utf-8")


def escape_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def build_map(input_path: str | Path, output: str | Path, compare: str | Path | None = None,
              n_clusters: Optional[int] = None, layout: str = "neighbors", seed: int = 0,
              text_chars: int = 240, png: str | Path | None = None,
              clusters_csv: str | Path | None = None) -> MapResult:
    run = load_run(input_path)
    other = load_run(compare) if compare else None
    change = loss_change(run, other) if other is not None else None
    n = len(run.loss)

    features = pca(unit_rows(run.embeddings), 50, seed)
    xy = features[:, :2] if features.shape[1] >= 2 else np.pad(features, ((0, 0), (0, 2 - features.shape[1])))
    if layout == "neighbors" and n > 2:
        xy = neighbor_layout(features, xy, n_epochs=200 if n <= 20000 else 120, seed=seed)
    xy = normalise_layout(xy)

    k = min(n_clusters or default_cluster_count(n), n)
    labels = renumber_by_loss(kmeans(features, k, seed), run.loss)
    words = cluster_labels(run.prompt.to_pylist(), labels)
    rows = cluster_table(run, labels, words, change)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_html(page_payload(run, xy, labels, rows, change, other, text_chars), output)
    png_path = Path(png) if png else output.with_suffix(".png")
    values, stops, value_range = ((change, CHANGE_STOPS, colour_range(change, True)) if change is not None
                                  else (run.loss, LOSS_STOPS, colour_range(run.loss)))
    # Draw by |value| for changes and by value for loss, so that what matters is on top.
    order = np.argsort(np.nan_to_num(np.abs(values) if change is not None else values, nan=-np.inf), kind="stable")
    png_path.write_bytes(encode_png(rasterise(xy, ramp_colours(values, value_range, stops), order)))
    csv_path = Path(clusters_csv) if clusters_csv else output.parent / "clusters.csv"
    write_clusters_csv(rows, csv_path)
    return MapResult(output, png_path, csv_path, n, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="an inference output_dir (or its inference.parquet)")
    parser.add_argument("--output", required=True, help="the HTML file to write, e.g. map.html")
    parser.add_argument("--compare", help="another inference run over the same data: colour by loss change "
                                          "(input minus compare) on the input's layout")
    parser.add_argument("--clusters", type=int, help="number of clusters (default: about sqrt(n/4), at most 40)")
    parser.add_argument("--layout", choices=("neighbors", "pca"), default="neighbors",
                        help="PCA refined by a nearest-neighbour force layout (default), or PCA alone")
    parser.add_argument("--seed", type=int, default=0, help="seed for PCA, the layout and k-means")
    parser.add_argument("--text-chars", type=int, default=240, help="prompt/response characters kept for hover")
    parser.add_argument("--png", help="static image path (default: the output with .png)")
    parser.add_argument("--clusters-csv", help="cluster table path (default: clusters.csv next to the output)")


def run(args: argparse.Namespace) -> int:
    if args.clusters is not None and args.clusters < 1:
        raise UserError(f"--clusters: must be at least 1, got {args.clusters}")
    if args.text_chars < 10:
        raise UserError(f"--text-chars: must be at least 10, got {args.text_chars}")
    result = build_map(args.input, args.output, args.compare, args.clusters, args.layout, args.seed,
                       args.text_chars, args.png, args.clusters_csv)
    hardest = result.clusters[0]
    print(f"{result.n_points} points, {len(result.clusters)} clusters; highest mean loss: cluster "
          f"{hardest['cluster']} ({hardest['label']}) {hardest['mean_loss']}")
    print(f"wrote {result.html}")
    print(f"wrote {result.png}")
    print(f"wrote {result.clusters_csv}")
    return 0


PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  * { box-sizing: border-box; }
  html, body { margin: 0; height: 100%; background: #111; color: #ddd; font: 13px/1.4 system-ui, sans-serif; }
  body { display: flex; }
  #plot { position: relative; flex: 1; min-width: 0; }
  #map { display: block; width: 100%; height: 100%; cursor: crosshair; }
  #side { width: 380px; display: flex; flex-direction: column; border-left: 1px solid #333; padding: 10px; }
  h1 { font-size: 15px; margin: 0 0 2px; }
  .sub { color: #888; font-size: 11px; word-break: break-all; margin-bottom: 8px; }
  .row { margin: 6px 0; display: flex; gap: 6px; align-items: center; }
  input, select { background: #222; color: #eee; border: 1px solid #444; padding: 4px; font: inherit; }
  #search { flex: 1; }
  #legend { margin: 6px 0; font-size: 12px; }
  .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
  .bar { height: 10px; border-radius: 2px; }
  .ends { display: flex; justify-content: space-between; color: #aaa; }
  #tablebox { flex: 1; overflow: auto; border-top: 1px solid #333; margin-top: 6px; }
  table { border-collapse: collapse; width: 100%; font-size: 12px; }
  th, td { padding: 3px 4px; text-align: left; border-bottom: 1px solid #2a2a2a; }
  th { position: sticky; top: 0; background: #181818; cursor: pointer; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  tr.cluster-row:hover { background: #222; cursor: pointer; }
  tr.cluster-row.active { background: #2d3a4a; }
  #tip { position: absolute; pointer-events: none; display: none; max-width: 440px; background: #1d1d1d;
         border: 1px solid #555; padding: 6px 8px; white-space: pre-wrap; font-size: 12px; z-index: 2; }
  #tip b { color: #fff; }
  #status { color: #aaa; font-size: 12px; }
</style>
</head>
<body>
<div id="plot"><canvas id="map"></canvas><div id="tip"></div></div>
<div id="side">
  <h1 id="title"></h1>
  <div class="sub" id="subtitle"></div>
  <div class="row">colour by <select id="colour-by"></select></div>
  <div class="row"><input id="search" type="search" placeholder="search prompts and responses"></div>
  <div id="status"><span id="rendered-count">0</span> of <span id="point-count">0</span> points drawn;
    <span id="match-count">0</span> highlighted. Scroll to zoom, drag to pan, double-click to reset.</div>
  <div id="legend"></div>
  <div id="tablebox"><table id="cluster-table"><thead><tr id="cluster-head"></tr></thead>
    <tbody id="cluster-body"></tbody></table></div>
</div>
<script type="application/json" id="map-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("map-data").textContent);
const N = D.x.length;
const canvas = document.getElementById("map"), ctx = canvas.getContext("2d");
const tip = document.getElementById("tip");
const rgb = c => "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")";
const BINS = 64;
let view = {scale: 1, ox: 0, oy: 0}, highlight = null, activeCluster = null, buckets = null;

// Colour modes: each maps a point to a bucket (drawn in bucket order, so high values end on top) and a legend.
const clusterNames = [];
for (const c of D.clusters) clusterNames[c.cluster] = c.cluster + ": " + c.label;
const modes = {
  loss: () => ramp(D.loss, D.loss_range, D.loss_stops, "loss"),
  cluster: () => categorical(D.cluster, clusterNames, "cluster"),
  source: () => categorical(D.source, D.sources, "source"),
  split: () => categorical(D.split, D.splits, "split"),
};
if (D.change) modes["loss change"] = () => ramp(D.change, D.change_range, D.change_stops, "loss change", true);

function mix(stops, t) {
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2);
  const f = x - i;
  return stops[i].map((v, j) => Math.round(v * (1 - f) + stops[i + 1][j] * f));
}
function ramp(values, range, stops, name, byMagnitude) {
  const [lo, hi] = range, colours = [], bucketOf = new Int32Array(N), order = [];
  for (let b = 0; b < BINS; b++) colours.push(rgb(mix(stops, b / (BINS - 1))));
  colours.push(rgb(D.missing));
  for (let i = 0; i < N; i++) {
    const v = values[i];
    bucketOf[i] = v === null ? BINS : Math.round(Math.min(Math.max((v - lo) / (hi - lo), 0), 1) * (BINS - 1));
  }
  // Missing first, then by value (by distance from the middle for changes): the notable points are drawn last.
  const rank = b => b === BINS ? -1 : (byMagnitude ? Math.abs(b - (BINS - 1) / 2) : b);
  for (let b = 0; b <= BINS; b++) order.push(b);
  order.sort((a, c) => rank(a) - rank(c));
  const stopsCss = stops.map((s, i) => rgb(s) + " " + (100 * i / (stops.length - 1)) + "%").join(",");
  const css = "linear-gradient(to right," + stopsCss + ")";
  return {bucketOf, colours, order, legend: {kind: "ramp", name, lo, hi, css}};
}
function categorical(codes, names, name) {
  const bucketOf = Int32Array.from(codes), order = names.map((_, i) => i);
  const colours = names.map((_, i) => rgb(D.categories[i % D.categories.length]));
  return {bucketOf, colours, order, legend: {kind: "list", name, names, colours}};
}

function group(mode) {
  const m = modes[mode](), lists = m.colours.map(() => []);
  for (let i = 0; i < N; i++) lists[m.bucketOf[i]].push(i);
  return Object.assign(m, {lists});
}

function resize() {
  const r = canvas.parentElement.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round(r.width * dpr));
  canvas.height = Math.max(1, Math.round(r.height * dpr));
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  draw();
}
function frame() {
  const w = canvas.clientWidth, h = canvas.clientHeight, pad = 12, side = Math.max(1, Math.min(w, h) - 2 * pad);
  return {left: (w - side) / 2, top: (h - side) / 2, side, w, h};
}
function toScreen(i, f) {
  return [(f.left + D.x[i] * f.side) * view.scale + view.ox, (f.top + (1 - D.y[i]) * f.side) * view.scale + view.oy];
}

function draw() {
  const f = frame();
  ctx.fillStyle = rgb(D.background);
  ctx.fillRect(0, 0, f.w, f.h);
  let drawn = 0;
  const size = N < 2000 ? 4 : N < 20000 ? 3 : 2, half = size / 2;
  const pass = (alpha, wanted) => {
    ctx.globalAlpha = alpha;
    for (const b of buckets.order) {
      ctx.fillStyle = buckets.colours[b];
      for (const i of buckets.lists[b]) {
        if (D.x[i] === null || (highlight !== null && highlight[i] !== wanted)) continue;
        const [sx, sy] = toScreen(i, f);
        if (sx < -3 || sy < -3 || sx > f.w + 3 || sy > f.h + 3) continue;
        ctx.fillRect(sx - half, sy - half, size, size);
        drawn++;
      }
    }
  };
  if (highlight === null) pass(0.9, 0);
  else {
    pass(0.12, 0);
    ctx.globalAlpha = 1;
    ctx.strokeStyle = "#fff";
    for (let i = 0; i < N; i++) {
      if (!highlight[i] || D.x[i] === null) continue;
      const [sx, sy] = toScreen(i, f);
      ctx.strokeRect(sx - 3, sy - 3, 6, 6);
    }
    pass(1, 1);
  }
  ctx.globalAlpha = 1;
  document.getElementById("rendered-count").textContent = drawn;
}

function setMode(mode) {
  buckets = group(mode);
  const legend = document.getElementById("legend"), lg = buckets.legend;
  legend.replaceChildren();
  if (lg.kind === "ramp") {
    const bar = document.createElement("div"), ends = document.createElement("div");
    bar.className = "bar"; bar.style.background = lg.css; ends.className = "ends";
    for (const t of [lg.lo.toPrecision(3), lg.name, lg.hi.toPrecision(3)]) {
      const s = document.createElement("span"); s.textContent = t; ends.appendChild(s);
    }
    legend.append(bar, ends);
  } else {
    lg.names.forEach((name, i) => {
      const item = document.createElement("div"), sw = document.createElement("span");
      sw.className = "swatch"; sw.style.background = lg.colours[i];
      item.append(sw, document.createTextNode(name));
      legend.appendChild(item);
    });
  }
  draw();
}

// Hover: a uniform grid over data space finds the nearest point without scanning all of them.
const G = 128, cellStart = new Int32Array(G * G + 1), cellItems = new Int32Array(N);
(function buildGrid() {
  const cell = i => Math.min(G - 1, Math.floor(D.x[i] * G)) * G + Math.min(G - 1, Math.floor(D.y[i] * G));
  const counts = new Int32Array(G * G + 1);
  for (let i = 0; i < N; i++) if (D.x[i] !== null) counts[cell(i) + 1]++;
  for (let c = 0; c < G * G; c++) counts[c + 1] += counts[c];
  cellStart.set(counts);
  const fill = counts.slice();
  for (let i = 0; i < N; i++) if (D.x[i] !== null) cellItems[fill[cell(i)]++] = i;
})();
function nearest(mx, my) {
  const f = frame(), scale = f.side * view.scale, radius = 8;
  const dx = ((mx - view.ox) / view.scale - f.left) / f.side, dy = 1 - ((my - view.oy) / view.scale - f.top) / f.side;
  const r = radius / scale, c0 = Math.floor((dx - r) * G), c1 = Math.floor((dx + r) * G);
  const d0 = Math.floor((dy - r) * G), d1 = Math.floor((dy + r) * G);
  let best = -1, bestD = radius * radius;
  for (let cx = Math.max(0, c0); cx <= Math.min(G - 1, c1); cx++)
    for (let cy = Math.max(0, d0); cy <= Math.min(G - 1, d1); cy++)
      for (let k = cellStart[cx * G + cy]; k < cellStart[cx * G + cy + 1]; k++) {
        const i = cellItems[k];
        if (highlight !== null && !highlight[i]) continue;
        const [sx, sy] = toScreen(i, f), d = (sx - mx) ** 2 + (sy - my) ** 2;
        if (d < bestD) { bestD = d; best = i; }
      }
  return best;
}
function showTip(i, mx, my) {
  if (i < 0) { tip.style.display = "none"; return; }
  const fmt = v => v === null ? "n/a" : v.toFixed(4);
  const cl = D.clusters.find(c => c.cluster === D.cluster[i]);
  let head = D.splits[D.split[i]] + " #" + D.index[i] + "  source " + D.sources[D.source[i]] +
             "\nloss " + fmt(D.loss[i]) + " over " + D.n_tokens[i] + " tokens";
  if (D.change) head += "  change " + fmt(D.change[i]);
  head += "\ncluster " + D.cluster[i] + ": " + cl.label;
  tip.replaceChildren();
  const b1 = document.createElement("b"), b2 = document.createElement("b");
  b1.textContent = "\nprompt: "; b2.textContent = "\nresponse: ";
  tip.append(document.createTextNode(head), b1, document.createTextNode(D.prompt[i]), b2,
             document.createTextNode(D.response[i]));
  tip.style.display = "block";
  const w = canvas.clientWidth;
  tip.style.left = Math.min(mx + 14, w - 450) + "px";
  tip.style.top = (my + 14) + "px";
}

// Search and cluster selection share one highlight mask.
const haystack = D.prompt.map((p, i) => (p + "\n" + D.response[i]).toLowerCase());
function setHighlight(mask) {
  highlight = mask;
  let count = 0;
  if (mask) for (let i = 0; i < N; i++) count += mask[i];
  document.getElementById("match-count").textContent = count;
  draw();
}
document.getElementById("search").addEventListener("input", e => {
  const q = e.target.value.trim().toLowerCase();
  activeCluster = null;
  document.querySelectorAll("tr.cluster-row.active").forEach(r => r.classList.remove("active"));
  if (!q) return setHighlight(null);
  setHighlight(Uint8Array.from(haystack, t => t.includes(q) ? 1 : 0));
});

const columns = [["cluster", "#"], ["label", "top prompt words"], ["size", "n"], ["mean_loss", "mean loss"]];
if (D.change) columns.push(["mean_loss_change", "mean change"]);
let sortKey = "mean_loss";
function fillTable() {
  const head = document.getElementById("cluster-head"), body = document.getElementById("cluster-body");
  head.replaceChildren();
  for (const [key, title] of columns) {
    const th = document.createElement("th");
    th.textContent = title + (key === sortKey ? " \u25bc" : "");
    th.addEventListener("click", () => { sortKey = key; fillTable(); });
    head.appendChild(th);
  }
  const numeric = sortKey !== "label";
  const rows = D.clusters.slice().sort((a, b) => numeric
      ? ((b[sortKey] ?? -Infinity) - (a[sortKey] ?? -Infinity)) || (a.cluster - b.cluster)
      : String(a.label).localeCompare(String(b.label)));
  body.replaceChildren();
  for (const c of rows) {
    const tr = document.createElement("tr");
    tr.className = "cluster-row" + (c.cluster === activeCluster ? " active" : "");
    tr.dataset.cluster = c.cluster;
    for (const [key] of columns) {
      const td = document.createElement("td"), v = c[key];
      td.textContent = typeof v === "number" && key.startsWith("mean") ? v.toFixed(4) : (v ?? "n/a");
      if (key !== "label") td.className = "num";
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => {
      activeCluster = activeCluster === c.cluster ? null : c.cluster;
      document.getElementById("search").value = "";
      fillTable();
      setHighlight(activeCluster === null ? null : Uint8Array.from(D.cluster, v => v === activeCluster ? 1 : 0));
    });
    body.appendChild(tr);
  }
}

// Zoom around the cursor, drag to pan, double-click to reset.
let drag = null;
canvas.addEventListener("wheel", e => {
  e.preventDefault();
  const k = Math.exp(-e.deltaY * 0.0015);
  view.ox = e.offsetX - (e.offsetX - view.ox) * k;
  view.oy = e.offsetY - (e.offsetY - view.oy) * k;
  view.scale *= k;
  draw();
}, {passive: false});
canvas.addEventListener("mousedown", e => { drag = {x: e.offsetX, y: e.offsetY}; });
window.addEventListener("mouseup", () => { drag = null; });
canvas.addEventListener("mousemove", e => {
  if (drag) {
    view.ox += e.offsetX - drag.x; view.oy += e.offsetY - drag.y;
    drag = {x: e.offsetX, y: e.offsetY};
    tip.style.display = "none";
    return draw();
  }
  showTip(nearest(e.offsetX, e.offsetY), e.offsetX, e.offsetY);
});
canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
canvas.addEventListener("dblclick", () => { view = {scale: 1, ox: 0, oy: 0}; draw(); });

document.getElementById("title").textContent = D.title;
document.getElementById("subtitle").textContent = D.subtitle;
document.getElementById("point-count").textContent = N;
const select = document.getElementById("colour-by");
for (const name of Object.keys(modes)) {
  const o = document.createElement("option"); o.value = o.textContent = name; select.appendChild(o);
}
// A link can carry the view: map.html#colour=source&search=volcano
const params = new URLSearchParams(location.hash.slice(1));
select.value = modes[params.get("colour")] ? params.get("colour") : (D.change ? "loss change" : "loss");
select.addEventListener("change", () => setMode(select.value));
fillTable();
buckets = group(select.value);
setMode(select.value);
if (params.get("search")) {
  const box = document.getElementById("search");
  box.value = params.get("search");
  box.dispatchEvent(new Event("input"));
}
window.addEventListener("resize", resize);
resize();
// #point=val:12 opens with that example's hover card, as if the pointer were on it.
const wanted = (params.get("point") || "").split(":");
const target = D.index.findIndex((v, i) => D.splits[D.split[i]] === wanted[0] && String(v) === wanted[1]);
if (target >= 0 && D.x[target] !== null) {
  const [sx, sy] = toScreen(target, frame());
  showTip(nearest(sx, sy), sx, sy);
}
document.body.dataset.ready = "1";
</script>
</body>
</html>
"""
