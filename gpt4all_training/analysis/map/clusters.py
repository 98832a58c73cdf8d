"""Clusters of the embedding features (scikit-learn's k-means) and their labels (class-based TF-IDF).

Clusters are k-means on the PCA features the layout uses, numbered by mean loss, hardest first. A cluster's label is
its most distinctive prompt words by class-based TF-IDF (BERTopic's c-TF-IDF): the prompts of a cluster are one
class; a word weighs its share of the class's prompts times log(1 + average class size / the word's prompts
overall), so words common everywhere ("number", "write") sink and words particular to the cluster rise.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from gpt4all_training.analysis.map.runs import Run
from gpt4all_training.files import atomic_file

# Words of instructions rather than topics, on top of scikit-learn's English stop words.
INSTRUCTION_WORDS = frozenset("""
give list tell describe explain write based using use provided following given text please like make know think
want need way let does did
""".split())


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


def kmeans_labels(features: np.ndarray, k: int, seed: int) -> np.ndarray:
    from sklearn.cluster import KMeans

    if k <= 1:
        return np.zeros(len(features), dtype=np.int64)
    return KMeans(n_clusters=k, random_state=seed, n_init=1).fit_predict(features).astype(np.int64)


def cluster_points(features: np.ndarray, loss: np.ndarray, n_clusters: Optional[int] = None,
                   seed: int = 0) -> np.ndarray:
    """Each row's cluster: k-means with `n_clusters` (default: about sqrt(n/4)), numbered by mean loss."""
    k = min(n_clusters or default_cluster_count(len(features)), len(features))
    return renumber_by_loss(kmeans_labels(features, k, seed), loss)


def cluster_labels(prompts: list[str], labels: np.ndarray, n_words: int = 3) -> list[str]:
    """Each cluster's top `n_words` prompt words by class-based TF-IDF, or "cluster N" when it has none."""
    from scipy import sparse
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, CountVectorizer

    n_clusters = int(labels.max()) + 1
    # binary: a prompt that repeats a word counts once, so one long prompt cannot name its cluster
    # max_df: a word in over half of all prompts ("number" in "number 1", "number 2", ...) tells no cluster apart
    vectorizer = CountVectorizer(stop_words=sorted(ENGLISH_STOP_WORDS | INSTRUCTION_WORDS), binary=True, max_df=0.5,
                                 token_pattern=r"(?u)\b[a-zA-Z][a-zA-Z0-9]{2,}\b")
    try:
        per_prompt = vectorizer.fit_transform([p or "" for p in prompts])
    except ValueError:  # nothing but stop words, numbers and punctuation
        return [f"cluster {c}" for c in range(n_clusters)]
    membership = sparse.csr_matrix((np.ones(len(labels)), (labels, np.arange(len(labels)))),
                                   shape=(n_clusters, len(labels)))
    counts = np.asarray((membership @ per_prompt).todense(), dtype=np.float64)  # prompts of cluster c with word w
    term_frequency = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    average_class_words = counts.sum() / n_clusters
    score = term_frequency * np.log1p(average_class_words / np.maximum(counts.sum(axis=0), 1.0))
    # a word that only one prompt of a larger cluster has says nothing about the cluster
    score[(counts < 2) & (np.bincount(labels, minlength=n_clusters)[:, None] > 1)] = 0.0
    words = vectorizer.get_feature_names_out()
    out = []
    for c in range(n_clusters):
        best = [i for i in np.argsort(-score[c], kind="stable")[:n_words] if score[c, i] > 0]
        out.append(", ".join(words[best]) if best else f"cluster {c}")
    return out


def named_clusters(features: np.ndarray, run: Run, n_clusters: Optional[int] = None,
                   seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Each row's cluster and each cluster's label: what the map shows and `curate` reports by."""
    labels = cluster_points(features, run.loss, n_clusters, seed)
    return labels, cluster_labels(run.prompt.to_pylist(), labels)


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
    with atomic_file(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
