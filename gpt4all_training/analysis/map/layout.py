"""The 2-D layout of the embeddings (pure NumPy).

How it is made, and why. Embeddings are centred and scaled to unit length (cosine geometry: a few huge hidden-state
dimensions would otherwise dominate), then reduced by PCA to at most 50 dimensions. PCA's first two components
alone keep global structure but pile distinct clusters on top of each other. t-SNE separates them, but exact t-SNE
costs O(n^2) per iteration, which NumPy cannot afford at tens of thousands of points, and neither UMAP nor
scikit-learn is a dependency of this project. So the default `--layout neighbors` refines the PCA layout with the
force model UMAP and LargeVis use: each point is pulled towards its 15 nearest neighbours (found exactly, in
blocks) and pushed from a few random points, with a heavy-tailed kernel. That costs O(n k) per epoch, starts from
PCA so the global arrangement survives, and is deterministic for a seed. `--layout pca` skips the refinement.
"""

from __future__ import annotations

import numpy as np

FEATURE_DIMENSIONS = 50  # PCA components kept for the layout's neighbours and for k-means


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


def normalize_layout(y: np.ndarray) -> np.ndarray:
    """Fit into [0, 1]^2 keeping the aspect ratio; the outermost 0.1% are pinned to the edge, not allowed to
    shrink everything else."""
    low, high = np.percentile(y, 0.1, axis=0), np.percentile(y, 99.9, axis=0)
    span = max(float((high - low).max()), 1e-12)
    centred = (y - (low + high) / 2) / span + 0.5
    return np.clip(centred, 0.0, 1.0)


def embedding_features(embeddings: np.ndarray, seed: int = 0) -> np.ndarray:
    """Unit-length rows reduced by PCA: the features the layout and the clusters share."""
    return pca(unit_rows(embeddings), FEATURE_DIMENSIONS, seed)


def layout_points(features: np.ndarray, method: str = "neighbors", seed: int = 0) -> np.ndarray:
    """Each row's position in [0, 1]^2: the first two PCA components, refined by `neighbor_layout` unless `method`
    is "pca"."""
    n = len(features)
    xy = features[:, :2] if features.shape[1] >= 2 else np.pad(features, ((0, 0), (0, 2 - features.shape[1])))
    if method == "neighbors" and n > 2:
        xy = neighbor_layout(features, xy, n_epochs=200 if n <= 20000 else 120, seed=seed)
    return normalize_layout(xy)
