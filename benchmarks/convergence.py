"""When has a run converged? The first round R at which the mean of the last `last` rounds' global
accuracy has moved less than `tolerance` points over the `window` rounds before R, for each run
folder given (its `metrics.jsonl`); and the budget that covers them all, rounded up to `window`.

    .venv/bin/python benchmarks/convergence.py outputs/suites/leaderboard-long/*

The leaderboard's statistic is the mean of the last 10 rounds: a budget at which that mean still
drifts ranks methods by how fast they learn, not by where they end (docs/leaderboard.md, "Budget").
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from fedskew.reports.stats import t_quantile


def last_means(accuracy: list[float], last: int) -> np.ndarray:
    """m[r] = the mean of rounds r - last + 1 .. r (percent), for r = last .. R (index r - last)."""
    a = 100 * np.asarray(accuracy, dtype=np.float64)
    return np.convolve(a, np.ones(last) / last, mode="valid")


def converged_round(accuracy: list[float], last: int = 10, window: int = 50, tolerance: float = 0.5) -> int | None:
    """The first round R (1-based) whose last-`last` mean, and every such mean of the `window` rounds
    before it, lie within `tolerance` points of each other; None if no round of the run does."""
    m = last_means(accuracy, last)
    for i in range(window, len(m)):
        span = m[i - window : i + 1]
        if span.max() - span.min() < tolerance:
            return i + last  # m[i] is the mean ending at round i + last
    return None


def end_trend(accuracy: list[float], window: int = 50) -> tuple[float, float, float]:
    """The least-squares line through the last `window` rounds' global accuracy (percent): how many
    points it moves across them, that movement's 95 % Student-t half-width (n - 2 degrees of
    freedom), and the rounds' sd around the line. The diagnostic where `converged_round` finds no
    round: a one-seed curve whose rounds scatter by sd has last-k means that scatter by about
    sd / sqrt(k), which a tolerance under that can never hold, while the line says whether the
    curve still climbs."""
    y = 100 * np.asarray(accuracy[-window:], dtype=np.float64)
    n = len(y)
    if n < 3:
        raise ValueError(f"a trend needs at least 3 rounds, got {n}")
    x = np.arange(n, dtype=np.float64) - (n - 1) / 2
    slope = float(x @ (y - y.mean()) / (x @ x))
    resid = y - y.mean() - slope * x
    sd = float(np.sqrt(resid @ resid / (n - 2)))
    half = t_quantile(n - 1) * sd / math.sqrt(float(x @ x))  # t with n - 2 degrees of freedom
    return slope * (n - 1), half * (n - 1), sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with its metrics.jsonl)")
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--tolerance", type=float, default=0.5, help="points")
    args = ap.parse_args()
    print(
        f"| run | rounds | converged at (last-{args.last} mean within {args.tolerance} over {args.window}) "
        f"| the last {args.window} rounds' line moves [95 %] | their sd around it |"
    )
    print("|---|---|---|---|---|")
    found = []
    for run in map(Path, args.runs):
        path = run / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        acc = [float(r["global-accuracy"]) for r in rows if r.get("global-accuracy") is not None]
        at = converged_round(acc, args.last, args.window, args.tolerance)
        found.append(at)
        move, half, sd = end_trend(acc, args.window)
        print(
            f"| {run.name} | {len(acc)} | {at if at is not None else 'not within the run'} "
            f"| {move:+.2f} [{move - half:+.2f}, {move + half:+.2f}] | {sd:.2f} |"
        )
    if found and None not in found:
        budget = int(math.ceil(max(found) / args.window) * args.window)
        print(f"\nbudget covering every run: {budget} rounds")
    elif found:
        print("\nsome runs have not converged within their rounds: run them longer")


if __name__ == "__main__":
    main()
