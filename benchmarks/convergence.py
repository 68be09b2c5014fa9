"""When has a run converged? Two readings of "the leaderboard's last-10 mean moves less than
`tolerance` points over the last `window` rounds", for each run folder given (its `metrics.jsonl`):

- literal (`converged_round`): the first round R at which the last-`last` mean, and every such mean
  of the `window` rounds before R, lie within `tolerance` of each other;
- by blocks (`settled_round`): the first R, a multiple of `window`, at which the mean of rounds
  R - window + 1 .. R differs from the mean of the `window` rounds before by less than `tolerance`;
- by trend (`trend_round`): the first R, a multiple of `window`, at which the least-squares slope
  of the last 4 block means is under `tolerance` a block (one block against the next can pass by
  chance where blocks still scatter by more than the tolerance, as on 2 classes a client).

One seed's rounds scatter by several points when a quarter of the clients train each round, so its
last-10 means scatter by about sd / sqrt(10), more than the tolerance: the literal test then never
passes however flat the curve, while a block of 50 rounds averages that scatter down about 2.2 times
further. Beside each run, its block means; below, each block's change from the one before averaged
over the runs with a 95 % t interval over them (how far the curves still climb, with its
uncertainty). The budget is the largest round that the chosen reading finds, rounded up to `window`.

    .venv/bin/python benchmarks/convergence.py outputs/suites/leaderboard-long/* [--doc docs/notes/convergence.md]

`--classes` adds each run's global per-class accuracy over the rounds the leaderboard reads (the
last 10 of `suites/leaderboard.yaml`'s budget: 31-40) and over its last `window` rounds: which
classes a method gains or loses with the budget (the mechanism behind a verdict that turns over).

`--metric` reads another accuracy of `metrics.jsonl` than `global-accuracy` (the personalized
methods' `personalized-pooled-accuracy`: does their best round still climb?).

`--doc` writes the tables, the command and the machine into the file's `convergence` block (or
`--block NAME`'s: one page holds several budgets' tables). The
leaderboard's statistic is the mean of the last 10 rounds: a budget at which that mean still drifts
ranks methods by how fast they learn, not by where they end (docs/leaderboard.md, "Budget").
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import yaml
from _common import ROOT, as_page_names, write_block

from fedskew.reports.leaderboard import LEADERBOARD_SUITE
from fedskew.reports.stats import t_interval
from fedskew.server_app.results import read_jsonl

TREND_BLOCKS = 4  # the block means a trend is fitted to (200 rounds at the default window)


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


def block_means(accuracy: list[float], window: int = 50) -> list[float]:
    """The mean accuracy (percent) of rounds 1..window, window+1..2 window, ... (whole blocks only)."""
    a = 100 * np.asarray(accuracy, dtype=np.float64)
    return [float(a[i : i + window].mean()) for i in range(0, len(a) - window + 1, window)]


def settled_round(accuracy: list[float], window: int = 50, tolerance: float = 0.5) -> int | None:
    """The first R = k window (k >= 2) whose block mean differs from the block before by less than
    `tolerance` points; None if no block of the run does."""
    b = block_means(accuracy, window)
    return next(((k + 1) * window for k in range(1, len(b)) if abs(b[k] - b[k - 1]) < tolerance), None)


def trend_round(accuracy: list[float], window: int = 50, tolerance: float = 0.5, blocks: int = 4) -> int | None:
    """The first R = k window (k >= `blocks`) at which the least-squares slope of the last `blocks`
    block means is under `tolerance` points a block: a drift, read through the blocks' scatter that
    one block against the next mistakes for a plateau (or for a climb); None if no R of the run."""
    b = np.asarray(block_means(accuracy, window))
    x = np.arange(blocks) - (blocks - 1) / 2
    for k in range(blocks, len(b) + 1):
        if abs(float(x @ b[k - blocks : k]) / float(x @ x)) < tolerance:
            return k * window
    return None


def _budget(found: list[int | None], window: int) -> str:
    if not found or None in found:
        return f"{found.count(None)} of {len(found)} runs not within their rounds"
    return f"{int(math.ceil(max(found) / window) * window)} rounds"


def table(runs: dict[str, list[float]], last: int, window: int, tolerance: float) -> list[str]:
    """The markdown lines: each run's round by both readings and its block means, the budgets, and
    each block's change from the one before averaged over the runs (95 % t interval over them)."""
    lines = [
        f"| run | rounds | literal: last-{last} mean within {tolerance} over {window} | by blocks: a {window}-round "
        f"mean within {tolerance} of the one before | by trend: the slope of the last {TREND_BLOCKS} {window}-round "
        f"means under {tolerance} a block | {window}-round means |",
        "|---|---|---|---|---|---|",
    ]
    literal, blocks, trend = [], [], []
    for name, acc in runs.items():
        literal.append(converged_round(acc, last, window, tolerance))
        blocks.append(settled_round(acc, window, tolerance))
        trend.append(trend_round(acc, window, tolerance, TREND_BLOCKS))
        means = ", ".join(f"{m:.1f}" for m in block_means(acc, window))
        at = [str(r) if r is not None else "not within the run" for r in (literal[-1], blocks[-1], trend[-1])]
        lines.append(f"| {name} | {len(acc)} | {at[0]} | {at[1]} | {at[2]} | {means} |")
    lines += [
        "",
        f"Budget covering every run: literal {_budget(literal, window)}; by blocks {_budget(blocks, window)}; "
        f"by trend {_budget(trend, window)}.",
    ]
    changes: dict[int, list[float]] = {}
    for acc in runs.values():
        b = block_means(acc, window)
        for k in range(1, len(b)):
            changes.setdefault((k + 1) * window, []).append(b[k] - b[k - 1])
    if len(runs) >= 2 and changes:
        lines += ["", f"| rounds | runs | change from the {window} rounds before, mean over the runs [95 %] |"]
        lines.append("|---|---|---|")
        for r, values in sorted(changes.items()):
            lines.append(f"| {r - window + 1}-{r} | {len(values)} | {t_interval(values).text()} |")
    return lines


def class_means(rows: list[dict], first: int, last: int) -> list[float] | None:
    """Each class's global accuracy (%) averaged over rounds first..last; None where no round there has it."""
    per = [
        r["global-per-class-accuracy"]
        for r in rows
        if first <= r.get("round", 0) <= last and r.get("global-per-class-accuracy")
    ]
    return [100 * float(v) for v in np.mean(per, axis=0)] if per else None


def class_table(rows: dict[str, list[dict]], early: int, window: int) -> list[str]:
    """Each run's per-class global accuracy over rounds early-9..early and over its last `window` rounds."""
    lines = [
        f"| run | rounds | per-class accuracy (%), rounds {early - 9}-{early} "
        f"| per-class accuracy (%), last {window} rounds |",
        "|---|---|---|---|",
    ]
    for name, run in rows.items():
        end = max((int(r.get("round", 0)) for r in run), default=0)
        cells = [class_means(run, early - 9, early), class_means(run, end - window + 1, end)]
        text = [" ".join(f"{v:.0f}" for v in c) if c else "-" for c in cells]
        lines.append(f"| {name} | {end} | {text[0]} | {text[1]} |")
    return lines


def command_runs(runs: list[str]) -> list[str]:
    """The runs as a page's command names them: `<folder>/*` where they are every run of one folder,
    else each run; a path in a checkout's `outputs/` from there on, as any checkout holds it."""
    paths = [Path(r).resolve() for r in runs]
    parents = {p.parent for p in paths}
    if len(parents) == 1:
        parent = parents.pop()
        if {p for p in parent.iterdir() if (p / "metrics.jsonl").is_file()} <= set(paths):
            paths = [parent / "*"]
    return [as_page_names(p) for p in paths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with its metrics.jsonl)")
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--tolerance", type=float, default=0.5, help="points")
    ap.add_argument(
        "--classes",
        action="store_true",
        help="also each run's per-class accuracy at the leaderboard's budget and at its end",
    )
    ap.add_argument("--metric", default="global-accuracy", help="the accuracy of metrics.jsonl read (a fraction)")
    ap.add_argument("--doc", type=Path, help="also write the tables, command and machine into this file's block")
    ap.add_argument("--block", default="convergence", help="with --doc: the block's name (default: convergence)")
    args = ap.parse_args()
    rows = {}
    for run in map(Path, args.runs):
        if found := read_jsonl(run / "metrics.jsonl"):  # a torn or damaged line skipped, not the run
            rows[run.name] = found
    runs = {name: [float(r[args.metric]) for r in run if r.get(args.metric) is not None] for name, run in rows.items()}
    if empty := [name for name, acc in runs.items() if not acc]:
        raise SystemExit(f"--metric {args.metric}: no round of {', '.join(empty)} records it")
    lines = table(runs, args.last, args.window, args.tolerance)
    if args.metric != ap.get_default("metric"):
        lines = [f"Metric: `{args.metric}`.", "", *lines]
    if args.classes:  # beside a run's end, the last 10 of the leaderboard's rounds
        budget = yaml.safe_load((ROOT / LEADERBOARD_SUITE).read_text())["base"]["num-server-rounds"]
        lines += ["", *class_table(rows, int(budget), args.window)]
    print("\n".join(lines))
    if args.doc:
        where = command_runs(args.runs)
        changed = [
            k for k in ("last", "window", "tolerance", "metric", "block") if getattr(args, k) != ap.get_default(k)
        ]
        options = ["--classes"] * args.classes + [f"--{k} {getattr(args, k)}" for k in changed]
        command = " ".join([*where, *options, f"--doc {args.doc}"])
        write_block(args.doc, args.block, f".venv/bin/python benchmarks/convergence.py {command}", lines)


if __name__ == "__main__":
    main()
