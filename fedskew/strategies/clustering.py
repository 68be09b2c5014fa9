"""MuPFL's ACMU maths (adaptive cluster-based model update, Zhang et al., Sec. 3.4, Eqs. 7-14), numpy only.

- Similarity (Eq. 8): Sim(i,j) = a cos(dw_i, dw_j) + (1 - a) cos(M_i, M_j), a = `alpha`.
- k-means needs points: each client is embedded as phi_i = [sqrt(a) dw_i/|dw_i|, sqrt(1-a) M_i/|M_i|],
  so that |phi_i - phi_j|^2 = 2 (1 - Sim(i,j)) and Euclidean k-means is consistent with Eq. 8.
- kappa (Eqs. 9-13): the k in [k_min, min(k_max, n-1)] whose k-means labels have the best mean
  silhouette on the distance 1 - Sim (Eq. 8 is a similarity); ties -> smallest k; n <= 2 -> 1.
- Cluster update (Eq. 14): w~_i = w_i^(t-1) + mean_{j in C(i)} dw_j (unweighted cluster mean).

A small numpy k-means (k-means++ seeding, best of `n_init` by inertia) and silhouette are written here
rather than adding scikit-learn for ~60 lines; the silhouette follows sklearn's definition (singleton
clusters score 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


def cosine_matrix(x: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of the rows of x (a zero row has cosine 0 with every row but itself)."""
    u = _unit_rows(x)
    sim = u @ u.T
    np.fill_diagonal(sim, 1.0)
    return np.clip(sim, -1.0, 1.0)


def similarity_matrix(updates: np.ndarray, maps: np.ndarray | None, alpha: float) -> np.ndarray:
    """Eq. 8: alpha * cos(updates) + (1 - alpha) * cos(maps); maps None means alpha = 1."""
    if maps is None:
        return cosine_matrix(updates)
    return alpha * cosine_matrix(updates) + (1.0 - alpha) * cosine_matrix(maps)


def embed(updates: np.ndarray, maps: np.ndarray | None, alpha: float) -> np.ndarray:
    """phi_i with |phi_i - phi_j|^2 = 2 (1 - Sim(i,j)) for the Sim of `similarity_matrix`."""
    if maps is None:
        return _unit_rows(updates)
    return np.concatenate([np.sqrt(alpha) * _unit_rows(updates), np.sqrt(1.0 - alpha) * _unit_rows(maps)], axis=1)


def low_rank(x: np.ndarray) -> np.ndarray:
    """n points in R^P as n points in R^min(n, P) with the same pairwise distances (x = U S V^T -> U S),
    so k-means on many-parameter updates costs O(n^2) per step instead of O(n P)."""
    u, s, _ = np.linalg.svd(np.asarray(x, dtype=np.float64), full_matrices=False)
    return u * s


def kmeans(
    x: np.ndarray, k: int, rng: np.random.Generator, n_init: int = 10, max_iter: int = 100
) -> tuple[np.ndarray, float]:
    """Lloyd's k-means with k-means++ seeding, best of `n_init` runs; returns (labels, inertia)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    best: tuple[np.ndarray, float] | None = None
    for _ in range(n_init):
        centers = [x[rng.integers(n)]]
        for _ in range(1, k):
            d2 = np.min(((x[:, None, :] - np.array(centers)[None]) ** 2).sum(-1), axis=1)
            p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
            centers.append(x[rng.choice(n, p=p)])
        c = np.array(centers)
        labels = np.full(n, -1)
        for _ in range(max_iter):
            d2 = ((x[:, None, :] - c[None]) ** 2).sum(-1)
            new = d2.argmin(1)
            if np.array_equal(new, labels):
                break
            labels = new
            for j in range(k):
                if (labels == j).any():
                    c[j] = x[labels == j].mean(0)
        inertia = float(((x - c[labels]) ** 2).sum())
        if best is None or inertia < best[1] - 1e-12:
            best = (labels, inertia)
    assert best is not None
    return best


def silhouette_score(distances: np.ndarray, labels: np.ndarray) -> float:
    """Eqs. 9-12: mean over points of (b - a) / max(a, b) on a precomputed distance matrix;
    a point alone in its cluster scores 0. Needs 2 <= #clusters <= n - 1."""
    labels = np.asarray(labels)
    ids = np.unique(labels)
    n = len(labels)
    if not 2 <= len(ids) <= n - 1:
        raise ValueError(f"silhouette needs 2..{n - 1} clusters, got {len(ids)}")
    s = np.zeros(n)
    for i in range(n):
        own = labels == labels[i]
        if own.sum() == 1:
            continue
        a = distances[i, own].sum() / (own.sum() - 1)
        b = min(distances[i, labels == c].mean() for c in ids if c != labels[i])
        denom = max(a, b)
        s[i] = (b - a) / denom if denom > 0 else 0.0
    return float(s.mean())


def select_clusters(
    updates: np.ndarray,
    maps: np.ndarray | None,
    alpha: float,
    k_min: int,
    k_max: int,
    rng: np.random.Generator,
    n_init: int = 10,
) -> tuple[np.ndarray, int, float]:
    """Eq. 13: (labels, kappa, silhouette) for the best kappa in [k_min, min(k_max, n - 1)].

    Fewer than 3 clients, or an empty range, give one cluster (silhouette NaN)."""
    n = len(updates)
    hi = min(k_max, n - 1)
    if n <= 2 or hi < max(k_min, 2):
        return np.zeros(n, dtype=int), 1, float("nan")
    phi = low_rank(embed(updates, maps, alpha))
    dist = np.clip(1.0 - similarity_matrix(updates, maps, alpha), 0.0, None)
    np.fill_diagonal(dist, 0.0)
    best: tuple[np.ndarray, int, float] | None = None
    for k in range(max(k_min, 2), hi + 1):
        labels, _ = kmeans(phi, k, rng, n_init=n_init)
        if len(np.unique(labels)) < 2:
            continue
        score = silhouette_score(dist, labels)
        if best is None or score > best[2] + 1e-12:
            best = (labels, k, score)
    if best is None:
        return np.zeros(n, dtype=int), 1, float("nan")
    return best


def cluster_update(bases: Sequence[np.ndarray], updates: Sequence[np.ndarray], labels: np.ndarray) -> list[np.ndarray]:
    """Eq. 14: w~_i = base_i + unweighted mean of the updates of i's cluster."""
    labels = np.asarray(labels)
    means = {c: np.mean([updates[j] for j in np.flatnonzero(labels == c)], axis=0) for c in np.unique(labels)}
    return [np.asarray(b) + means[c] for b, c in zip(bases, labels, strict=True)]
