"""The 2-D layout of the embeddings: PCA features (scikit-learn), laid out by UMAP (umap-learn).

Embeddings are centred and scaled to unit length before PCA: a causal LM's hidden states share a few huge
dimensions and a common direction, which would otherwise decide every distance. The first 50 principal components
are the features that UMAP and the clusters share. UMAP keeps neighbourhoods, which PCA's first two components pile
on top of each other; its neighbours are found exactly (see `umap_layout`), which dominates at 100k points.
`--layout pca` skips UMAP for a quick look at very large runs.

umap-learn compiles its kernels with numba on first use, in every new process, because a few of them are not
marked for numba's on-disk cache. `configure_numba` marks them, so with NUMBA_CACHE_DIR set (the Makefile and
the tests put it under .cache/) a later process loads them from disk instead of compiling them again (BENCHMARKS.md,
section 9, has the times).
"""

from __future__ import annotations

import warnings

import numpy as np

FEATURE_DIMENSIONS = 50  # PCA components kept for UMAP's neighbours and for k-means
LAYOUTS = ("umap", "pca")
N_NEIGHBORS = 15  # UMAP's default: local enough to separate topics, global enough to keep them in one map


def embedding_features(embeddings: np.ndarray, seed: int = 0) -> np.ndarray:
    """Centred, unit-length rows reduced by PCA to at most FEATURE_DIMENSIONS columns."""
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import normalize

    x = normalize(embeddings - embeddings.mean(axis=0, dtype=np.float64))
    n_components = min(FEATURE_DIMENSIONS, *x.shape)
    if not np.any(x):  # one point, or all identical: no direction to find
        return np.zeros((len(x), n_components), dtype=np.float32)
    return PCA(n_components, random_state=seed).fit_transform(x).astype(np.float32)


def configure_numba() -> None:
    """Before umap-learn runs: its uncached kernels marked for numba's disk cache (see the module docstring), and
    numba's own thread pool instead of its OpenMP one, which shares torch's OpenMP runtime and raised torch's thread
    count: a training step run in the same process after a map was 15 times slower."""
    import numba
    from umap import layouts, umap_

    numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]  # numba reads its config at run time
    for kernel in (umap_.smooth_knn_dist, umap_.compute_membership_strengths,
                   layouts._nb_optimize_layout_euclidean_single_epoch):
        kernel.enable_caching()


def umap_layout(features: np.ndarray, seed: int) -> np.ndarray:
    import umap
    from sklearn.neighbors import NearestNeighbors

    configure_numba()
    k = min(N_NEIGHBORS, len(features) - 1)
    # Neighbours from scikit-learn (exact, vectorised), not from umap-learn: below 4,096 points it calls a numba
    # distance once per pair from Python (15 s for 1,000 points), and above that pynndescent compiles kernels that
    # numba cannot cache ("dynamic globals") in every process: about 110 s on 2 cores, as long as scikit-learn takes
    # for 60k points.
    distances, indices = NearestNeighbors(n_neighbors=k).fit(features).kneighbors(features)
    # random_state makes UMAP deterministic (it then runs single-threaded): the same input gives the same map.
    # init="pca" starts from the first two principal components, so the global arrangement is PCA's; UMAP's
    # spectral start needs an eigensolver on the neighbour graph that took 100 s more at 100k points.
    reducer = umap.UMAP(n_neighbors=k, n_components=2, random_state=seed, n_jobs=1, init="pca",
                        precomputed_knn=(indices, distances))
    with warnings.catch_warnings():
        # "transforming new data with transform will be unavailable": the map never places new points
        warnings.filterwarnings("ignore", message="precomputed_knn", category=UserWarning)
        return reducer.fit_transform(features)


def normalize_layout(y: np.ndarray) -> np.ndarray:
    """Fit into [0, 1]^2 keeping the aspect ratio; the outermost 0.1% are pinned to the edge, not allowed to
    shrink everything else."""
    low, high = np.percentile(y, 0.1, axis=0), np.percentile(y, 99.9, axis=0)
    span = max(float((high - low).max()), 1e-12)
    centred = (y - (low + high) / 2) / span + 0.5
    return np.clip(centred, 0.0, 1.0)


def layout_points(features: np.ndarray, method: str = "umap", seed: int = 0) -> np.ndarray:
    """Each row's position in [0, 1]^2: UMAP of the features, or their first two principal components."""
    xy = features[:, :2] if features.shape[1] >= 2 else np.pad(features, ((0, 0), (0, 2 - features.shape[1])))
    # UMAP's spectral start needs a few points beyond the neighbour count; below that PCA is the whole story.
    if method == "umap" and len(features) > 4:
        xy = umap_layout(features, seed)
    return normalize_layout(xy)
