"""Pure aggregation maths (numpy): weighted model averaging, per-round metric summaries, and the
server rules of SCAFFOLD (control variates, server step), FedNova (normalised averaging) and FedDyn
(h and the server model); each docstring gives the equation."""

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


def pooled_accuracy(tested: Sequence[tuple[float, float]]) -> float:
    """sum_k a_k n_k / sum_k n_k over (accuracy a_k, test samples n_k): the clients' correct answers
    over their test samples (NaN when no client tested a sample)."""
    n = sum(count for _, count in tested)
    return float(sum(acc * count for acc, count in tested) / n) if n > 0 else float("nan")


Arrays = Mapping[str, np.ndarray]


def _cast(values: dict[str, np.ndarray], like: Arrays) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(like[k].dtype).reshape(np.shape(like[k])) for k, v in values.items()}


def l2_norm(arrays: Arrays) -> float:
    """sqrt(sum of squares) over every array (a diagnostic of a model-sized state)."""
    return float(np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in arrays.values())))


def server_step(x: Arrays, average: Arrays, lr: float) -> dict[str, np.ndarray]:
    """SCAFFOLD's server model update (Karimireddy et al., ICML'20, Alg. 1 lines 16-17, Delta x the
    averaged Delta y_i): x + eta_g (avg - x) for floating arrays; integer buffers take the average.
    eta_g = 1 returns the average itself."""
    if lr == 1.0:
        return dict(average)
    out = {}
    for k, a in average.items():
        if np.issubdtype(a.dtype, np.integer):
            out[k] = a
        else:
            x64 = np.asarray(x[k], dtype=np.float64)
            out[k] = x64 + lr * (np.asarray(a, dtype=np.float64) - x64)
    return _cast(out, average)


def server_momentum_step(
    x: Arrays, average: Arrays, momentum: Arrays, lr: float, beta: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """FedAvgM's server update (Hsu, Qi & Brown 2019, Sec. 3; SGD with momentum on the pseudo-gradient,
    as `torch.optim.SGD` and Flower's `FedAvgM` write it):

        Delta = x - avg,   v <- beta v + Delta,   x <- x - eta v

    over the arrays of `momentum` (the trainable parameters); every other array (BatchNorm's
    statistics and counters) takes the average. beta = 0 and eta = 1 give the average (FedAvg).
    Computed in float64; returns (the new model in `average`'s dtypes, v as float32)."""
    out, v = dict(average), {}
    for k, m in momentum.items():
        x64 = np.asarray(x[k], dtype=np.float64)
        v[k] = beta * np.asarray(m, dtype=np.float64) + (x64 - np.asarray(average[k], dtype=np.float64))
        out[k] = x64 - lr * v[k]
    return _cast(out, average), {k: a.astype(np.float32) for k, a in v.items()}


def scaffold_control_update(control: Arrays, deltas: Sequence[Arrays], num_clients: int) -> dict[str, np.ndarray]:
    """SCAFFOLD's server control variate (Alg. 1 lines 16-17): c + |S|/N * mean_{i in S} Delta c_i
    = c + (1/N) sum_{i in S} Delta c_i, so that c stays the mean of all N clients' c_i."""
    total = {n: np.asarray(c, np.float64) + sum(d[n] for d in deltas) / num_clients for n, c in control.items()}
    return _cast(total, control)


def fednova_normalizer(steps: int, momentum: float = 0.0) -> float:
    """FedNova's a_i = ||a_i||_1 for local SGD with heavy-ball momentum rho (Wang et al., NeurIPS'20,
    Sec. 4-5; `JYWa/FedNova`'s `local_normalizing_vec`): the sum over the tau local steps of
    the weight the momentum buffer gives to each gradient,
        a = sum_{t=1}^{tau} (1 - rho^t) / (1 - rho) = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho),
    and a = tau for plain SGD (rho = 0)."""
    if momentum == 0.0:
        return float(steps)
    return (steps - momentum * (1.0 - momentum**steps) / (1.0 - momentum)) / (1.0 - momentum)


def normalized_average(
    x: Arrays, models: Sequence[Arrays], weights: Sequence[float], normalizers: Sequence[float]
) -> dict[str, np.ndarray]:
    """FedNova's normalized averaging over the arrays of `x`:
        x+ = x - tau_eff sum_i p_i (x - y_i) / a_i,   tau_eff = sum_i p_i a_i,   p_i = w_i / sum_j w_j.
    With equal a_i it is the weighted average sum_i p_i y_i (FedAvg); a client that took more steps
    (larger a_i) weighs less than in FedAvg, which removes FedAvg's bias towards such clients."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    a = np.asarray(normalizers, dtype=np.float64)
    tau_eff = float((p * a).sum())
    out = {}
    for k, x_k in x.items():
        x64 = np.asarray(x_k, dtype=np.float64)
        out[k] = x64 - tau_eff * sum(pi / ai * (x64 - y[k]) for pi, ai, y in zip(p, a, models, strict=True))
    return _cast(out, x)


def feddyn_server_update(
    h: Arrays, x: Arrays, models: Sequence[Arrays], average: Arrays, alpha: float, num_clients: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """FedDyn's server (Acar et al., ICLR'21, Alg. 1), over the arrays of `h`:
        h+ = h - alpha (1/m) sum_{k in P_t} (theta_k - theta^{t-1}),   theta^t = avg_k theta_k - h+ / alpha,
    m the number of clients; returns (h+, theta^t)."""
    h_new, theta = {}, {}
    for n, h_n in h.items():
        x64 = np.asarray(x[n], dtype=np.float64)
        h_new[n] = np.asarray(h_n, np.float64) - alpha / num_clients * sum(y[n] - x64 for y in models)
        theta[n] = np.asarray(average[n], dtype=np.float64) - h_new[n] / alpha
    return _cast(h_new, h), _cast(theta, h)


# ------------------------------------------------------------------ robust aggregation
ROBUST_RULES = ("none", "median", "trimmed-mean")


def _measured(model: Arrays, start: Arrays | None, key: str) -> bool:
    """Whether `update_norm` counts `model[key]`: a floating array that `start` holds with the same
    shape (every floating array when `start` is None)."""
    w = model[key]
    if np.asarray(w).dtype.kind != "f":
        return False
    return start is None or (key in start and np.shape(start[key]) == np.shape(w))


def update_norm(model: Arrays, start: Arrays | None) -> float:
    """||w - w0||_2 over the floating arrays of `model` that `start` holds with the same shape, in
    float64 (`update_ratio`'s numerator); with `start` None the arrays are the update themselves."""
    total = 0.0
    for key, w in model.items():
        if _measured(model, start, key):
            d = np.asarray(w, np.float64) - (0.0 if start is None else np.asarray(start[key], np.float64))
            total += float(np.square(d).sum())
    return math.sqrt(total)


def norm_bound(norms: Sequence[float], multiple: float) -> float:
    """The round's bound M = multiple x median_i ||Delta_i|| (Sun et al., "Can You Really Backdoor
    Federated Learning?", 2019, Sec. 4: norm thresholding, with M relative to the round's median
    instead of a fixed constant). inf (no bound) for `multiple` 0, no update, or a zero median."""
    median = float(np.median(np.asarray(norms, np.float64))) if len(norms) else 0.0
    return multiple * median if multiple > 0 and median > 0 else math.inf


def clip_update(model: Arrays, start: Arrays | None, max_norm: float) -> dict[str, np.ndarray] | None:
    """w0 + (w - w0) M / ||w - w0|| over the arrays `update_norm` measures (the others as they are),
    cast back to each array's dtype; None when ||w - w0|| <= M (nothing to clip: the caller keeps
    the reply's arrays as they came, bit for bit). With `start` None: w M / ||w||."""
    norm = update_norm(model, start)
    if norm <= max_norm:
        return None
    scale = max_norm / norm
    out = dict(model)
    for key, w in model.items():
        if _measured(model, start, key):
            w0 = 0.0 if start is None else np.asarray(start[key], np.float64)
            clipped = w0 + (np.asarray(w, np.float64) - w0) * scale
            out[key] = clipped.astype(np.asarray(w).dtype).reshape(np.shape(w))
    return out


def coordinate_median(models: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """The coordinate-wise median of the models (Yin et al., "Byzantine-Robust Distributed Learning",
    ICML'18, Def. 1), per tensor in float64, cast back (integer buffers rounded)."""
    return _coordinatewise(models, lambda s: np.median(s, axis=0))


def trimmed_mean(models: Sequence[Arrays], fraction: float) -> dict[str, np.ndarray]:
    """The coordinate-wise beta-trimmed mean (Yin et al., ICML'18, Def. 2): per coordinate, drop the
    k = floor(beta n) smallest and k largest of the n values and average the rest (beta < 1/2)."""
    if not 0.0 <= fraction < 0.5:
        raise ValueError(f"trim fraction {fraction} is outside [0, 0.5)")
    k = math.floor(fraction * len(models))
    return _coordinatewise(models, lambda s: np.sort(s, axis=0)[k : len(models) - k].mean(axis=0))


def _coordinatewise(models: Sequence[Arrays], reduce) -> dict[str, np.ndarray]:
    if not models:
        raise ValueError("a robust mean needs at least one model")
    out = {}
    for key, first in models[0].items():
        acc = reduce(np.stack([np.asarray(m[key], dtype=np.float64) for m in models]))
        if np.issubdtype(np.asarray(first).dtype, np.integer):
            acc = np.rint(acc)
        out[key] = np.asarray(acc).astype(np.asarray(first).dtype).reshape(np.shape(first))
    return out


def robust_mean(
    models: Sequence[Arrays], weights: Sequence[float], rule: str = "none", fraction: float = 0.1
) -> dict[str, np.ndarray]:
    """The round's mean under `robust-aggregation`: "none" is `weighted_average` itself; "median" and
    "trimmed-mean" (fraction `fraction`) are the coordinate-wise rules, which weigh every client alike
    (a client's claimed size must not buy it a larger say in a rule meant to resist it)."""
    if rule == "none":
        return weighted_average(models, weights)
    if rule == "median":
        return coordinate_median(models)
    if rule == "trimmed-mean":
        return trimmed_mean(models, fraction)
    raise ValueError(f"robust-aggregation={rule!r}: must be one of {ROBUST_RULES}")


def robust_pool(
    values: Sequence[Arrays], rule: str = "none", fraction: float = 0.1, origin: Arrays | None = None
) -> list[dict[str, np.ndarray]]:
    """What a server state sums over a round's clients (SCAFFOLD's Delta c_i, FedDyn's theta_k,
    FedDC's theta_i - w), under `robust-aggregation`: "none" returns `values` as they are (the
    state's sum is the papers'); otherwise one value o + |S| (mean_rule(values) - o), whose sum
    moves the state as much as |S| clients at the robust mean would (`origin` o: 0 when None)."""
    if rule == "none":
        return [dict(v) for v in values]
    center = robust_mean(values, [1.0] * len(values), rule, fraction)
    n = len(values)
    if origin is None:
        return [{k: np.asarray(v, np.float64) * n for k, v in center.items()}]
    return [{k: origin[k] + n * (np.asarray(v, np.float64) - origin[k]) for k, v in center.items()}]


def class_robust_mean(uploads: Sequence[Mapping[int, np.ndarray]], rule: str, fraction: float) -> dict[int, np.ndarray]:
    """Per class k, the coordinate-wise rule ("median", "trimmed-mean") over exactly the clients that
    uploaded a statistic of class k (a prototype, a class gradient), every holder alike; float64."""
    held: dict[int, list[dict[str, np.ndarray]]] = {}
    for upload in uploads:
        for k, v in upload.items():
            held.setdefault(int(k), []).append({"v": np.asarray(v, np.float64)})
    return {k: robust_mean(vs, [1.0] * len(vs), rule, fraction)["v"] for k, vs in sorted(held.items())}


def normalized_models(
    x: Arrays, models: Sequence[Arrays], weights: Sequence[float], normalizers: Sequence[float]
) -> list[dict[str, np.ndarray]]:
    """FedNova's per-client terms z_i = x - tau_eff (x - y_i) / a_i over the arrays of `x`, whose
    p-weighted mean is `normalized_average`; a robust rule takes their coordinate-wise median
    or trimmed mean instead (float64)."""
    p = np.asarray(weights, dtype=np.float64)
    tau_eff = float((p / p.sum() * np.asarray(normalizers, dtype=np.float64)).sum())
    out = []
    for y, a in zip(models, normalizers, strict=True):
        out.append(
            {k: np.asarray(v, np.float64) - tau_eff / a * (np.asarray(v, np.float64) - y[k]) for k, v in x.items()}
        )
    return out
