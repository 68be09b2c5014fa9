"""When has a run converged? The first round R at which the mean of the last `last` rounds' global
accuracy has moved less than `tolerance` points over the `window` rounds before R, for each run
folder given (its `metrics.jsonl`); and the budget that covers them all, rounded up to `window`.

    .venv/bin/python benchmarks/convergence.py outputs/suites/leaderboard-long/* [--doc docs/notes/convergence.md]

Beside it, the diagnostic of a run where no round passes (one seed's rounds scatter more than the
tolerance): the least-squares line through its last `window` rounds, and that line's movement over
each window averaged over the runs, with a 95 % t interval over them. `--doc` writes the tables, the
command and the machine into the file's `convergence` block.

The leaderboard's statistic is the mean of the last 10 rounds: a budget at which that mean still
drifts ranks methods by how fast they learn, not by where they end (docs/leaderboard.md, "Budget").
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from _common import machine

from fedskew.files import write_text
from fedskew.reports.report import replace_block
from fedskew.reports.stats import t_interval, t_quantile


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


def window_trends(accuracy: list[float], window: int = 50) -> dict[int, float]:
    """Round R -> the points the least-squares line through rounds R - window + 1 .. R moves, for
    each R that is a multiple of `window` (`end_trend` of the run cut at R)."""
    return {r: end_trend(accuracy[:r], window)[0] for r in range(window, len(accuracy) + 1, window)}


def table(runs: dict[str, list[float]], last: int, window: int, tolerance: float) -> list[str]:
    """The markdown lines: each run's converged round and end trend, the budget covering them, and
    the line's movement over each window averaged over the runs (95 % t interval over the runs)."""
    lines = [
        f"| run | rounds | converged at (last-{last} mean within {tolerance} over {window}) "
        f"| the last {window} rounds' line moves [95 %] | their sd around it |",
        "|---|---|---|---|---|",
    ]
    found = []
    for name, acc in runs.items():
        at = converged_round(acc, last, window, tolerance)
        found.append(at)
        move, half, sd = end_trend(acc, window)
        lines.append(
            f"| {name} | {len(acc)} | {at if at is not None else 'not within the run'} "
            f"| {move:+.2f} [{move - half:+.2f}, {move + half:+.2f}] | {sd:.2f} |"
        )
    if found and None not in found:
        lines += ["", f"Budget covering every run: {int(math.ceil(max(found) / window) * window)} rounds."]
    elif found:
        lines += ["", f"{found.count(None)} of {len(found)} runs have not converged within their rounds."]
    trends = [window_trends(acc, window) for acc in runs.values()]
    ends = sorted({r for t in trends for r in t})
    if len(runs) >= 2 and ends:
        lines += ["", f"| rounds | runs | the line moves over the {window} rounds, mean over the runs [95 %] |"]
        lines.append("|---|---|---|")
        for r in ends:
            iv = t_interval([t[r] for t in trends if r in t])
            lines.append(f"| {r - window + 1}-{r} | {iv.n} | {iv.text()} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with its metrics.jsonl)")
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--tolerance", type=float, default=0.5, help="points")
    ap.add_argument("--doc", type=Path, help="also write the tables, command and machine into this file's block")
    args = ap.parse_args()
    runs = {}
    for run in map(Path, args.runs):
        path = run / "metrics.jsonl"
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            runs[run.name] = [float(r["global-accuracy"]) for r in rows if r.get("global-accuracy") is not None]
    lines = table(runs, args.last, args.window, args.tolerance)
    print("\n".join(lines))
    if args.doc:
        parents = {Path(r).parent for r in args.runs}
        where = [f"{parents.pop()}/*"] if len(parents) == 1 else args.runs
        changed = [k for k in ("last", "window", "tolerance") if getattr(args, k) != ap.get_default(k)]
        options = [f"--{k} {getattr(args, k)}" for k in changed]
        command = " ".join([*where, *options, f"--doc {args.doc}"])
        body = ["```bash", f".venv/bin/python benchmarks/convergence.py {command}", "```", "", machine(), "", *lines]
        write_text(args.doc, replace_block(args.doc.read_text(), "convergence", body, str(args.doc)))


if __name__ == "__main__":
    main()
