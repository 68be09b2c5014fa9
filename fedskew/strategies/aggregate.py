"""Pure aggregation maths (numpy): weighted model averaging and per-round metric summaries."""

from __future__ import annotations

import math
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


def update_ratio(model: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> float:
    """||w - w0||_2 / max(||w0||_2, 1) over the floating arrays of `model` that `start` holds with
    the same shape, in float64 (0 when there are none, e.g. an upload without model arrays).

    The size of a client's update relative to the model it started from: honest local training moves
    a model by a fraction of its norm to a few times it (the round's largest ratio is logged as
    `update-ratio-max`); a finite but extreme reply (3.4e38 weights) is beyond it by dozens of orders."""
    diff = norm = 0.0
    for key, w in model.items():
        w0 = start.get(key)
        if w0 is None or np.shape(w0) != np.shape(w) or np.asarray(w).dtype.kind != "f":
            continue
        w64, w0_64 = np.asarray(w, np.float64), np.asarray(w0, np.float64)
        diff += float(np.square(w64 - w0_64).sum())
        norm += float(np.square(w0_64).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1.0)


def summarize_clients(values: Sequence[float]) -> tuple[float, float]:
    """Unweighted mean and population std over clients (NaN when empty)."""
    if len(values) == 0:
        return float("nan"), float("nan")
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std())
