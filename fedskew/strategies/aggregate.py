"""Pure aggregation maths (numpy): weighted model averaging and per-round metric summaries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def weighted_average(models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_k w_k theta_k / sum_k w_k per tensor, computed in float64 and cast back to each
    tensor's dtype (integer buffers such as BN's `num_batches_tracked` are rounded)."""
    if not models:
        raise ValueError("weighted_average needs at least one model")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(models),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {len(models)} non-negative numbers with a positive sum")
    w = w / w.sum()
    out = {}
    for key, first in models[0].items():
        acc = np.asarray(sum(wk * np.asarray(m[key], dtype=np.float64) for wk, m in zip(w, models, strict=True)))
        if np.issubdtype(first.dtype, np.integer):
            acc = np.rint(acc)
        out[key] = acc.astype(first.dtype).reshape(np.shape(first))  # 0-d buffers stay 0-d

    return out


def summarize_clients(values: Sequence[float]) -> tuple[float, float]:
    """Unweighted mean and population std over clients (NaN when empty)."""
    if len(values) == 0:
        return float("nan"), float("nan")
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std())
