"""Clusters of the embedding features and their labels (pure NumPy).

Clusters are k-means (k-means++ start) on the PCA features the layout uses, numbered by mean loss, hardest first.
A cluster's label is its most distinctive prompt words: those whose share of the cluster's prompts most exceeds
their share of all prompts, weighted by how common they are in the cluster (each word's term of the KL divergence).
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from gpt4all_training.analysis.map.runs import Run

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


def cluster_points(features: np.ndarray, loss: np.ndarray, n_clusters: Optional[int] = None,
                   seed: int = 0) -> np.ndarray:
    """Each row's cluster: k-means with `n_clusters` (default: about sqrt(n/4)), numbered by mean loss."""
    k = min(n_clusters or default_cluster_count(len(features)), len(features))
    return renumber_by_loss(kmeans(features, k, seed), loss)


def cluster_table(run: Run, labels: np.ndarray, words: list[str], change: Optional[np.ndarray]) -> list[dict]:
    """One row per cluster (label, size, loss statistics, top source, rows per split), highest mean loss first."""
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

