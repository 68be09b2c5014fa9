"""The cells the committed pages need run again, one line per batch: `<suite> <partition/method>,...`.

Two kinds, per suite (`suites/<name>.yaml` with `results/<name>.yaml`): the cells recorded under an
earlier config than today's (`fedskew.run.experiments.stale_cells`: their numbers are of another
config), and the cells a claim's gain needs to be paired by seed
(`fedskew.reports.report.unpaired_claim_cells`: a side recorded without per-seed values). Each batch
holds `--group` cells, in the suite's order, so that a queue that runs a batch's seeds together and
then exports it (`scripts/queue.sh`, item `rerun`) never writes a cell with part of its seeds over
one recorded with all of them.
With `--pending SEED` it lists instead the cells a run of that seed still runs (`plan_cells`: not
recorded in the result file, not finished in the suite's folder; with `--rerun-changed`, also those
finished under another config), for the queue's item `each`, which runs them all in one call
(`--group 0`), two at a time, exporting each cell as it finishes, so that a session that ends mid-seed
keeps the cells it finished and no core waits for a pair's slower cell. `--methods` keeps those
methods' cells, in the order given: a suite too long for the machine runs its key methods first, at
every seed, so that what finishes holds paired seeds.

    .venv/bin/python scripts/rerun_cells.py [--group 2] [--suites paper-mupfl,paper-map]
    .venv/bin/python scripts/rerun_cells.py --suites peer-niid-bench --pending 1 [--rerun-changed]
    .venv/bin/python scripts/rerun_cells.py --suites leaderboard-converged --pending 0 --methods fedavg,fedrs
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedskew.cli import app_defaults
from fedskew.config import ConfigError
from fedskew.reports.report import Evidence, load_claims, unpaired_claim_cells
from fedskew.reports.resultfile import load_all
from fedskew.run.experiments import Suite, load_suite, plan_cells, select, stale_cells

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--group", type=int, default=2, help="cells a line (default 2: a pair of cells keeps 2 cores busy; 0: all)"
    )
    ap.add_argument(
        "--suites", metavar="A,B", help="only these suites, in this order (default: every suite with a result file)"
    )
    ap.add_argument("--pending", type=int, metavar="SEED", help="the cells a run of this seed still runs")
    ap.add_argument(
        "--rerun-changed", action="store_true", help="with --pending: count a cell finished under another config"
    )
    ap.add_argument("--methods", metavar="A,B", help="with --pending: only these methods' cells, in this order")
    args = ap.parse_args()
    if args.group < 0:
        ap.error(f"--group {args.group} is not allowed: must be 1 or more, or 0 (every cell on one line)")
    if args.rerun_changed and args.pending is None:
        ap.error("--rerun-changed is for --pending SEED")
    if args.methods and args.pending is None:
        ap.error("--methods is for --pending SEED")
    defaults = app_defaults(ROOT)
    have = sorted(p.stem for p in (ROOT / "suites").glob("*.yaml"))
    if args.pending is None:
        have = [n for n in have if (ROOT / "results" / f"{n}.yaml").is_file()]
    names = args.suites.split(",") if args.suites else have
    if unknown := [n for n in names if n not in have]:
        kind = "suite" if args.pending is not None else "suite with a result file"
        ap.error(f"--suites: no {kind} {unknown[0]!r} (allowed: {', '.join(have)})")
    claims = {}
    if args.pending is None:
        evidence = Evidence(load_all(ROOT / "results"))
        claims = unpaired_claim_cells(load_claims(ROOT / "results/claims.yaml"), evidence)
    for name in names:
        path = ROOT / "suites" / f"{name}.yaml"
        try:
            suite = load_suite(path, defaults)
            if args.pending is not None:
                methods = args.methods.split(",") if args.methods else None
                order = pending_cells(suite, args.pending, args.rerun_changed, methods)
            else:
                need = {*stale_cells(suite, ROOT, defaults), *claims.get(path.stem, [])}
                order = [c for c in dict.fromkeys(c.cell for c in suite.cells) if c in need]
        except ConfigError as e:
            ap.error(str(e))
        for batch in batches(order, args.group):
            print(path.stem, ",".join(batch))


def batches(cells: list[str], group: int) -> list[list[str]]:
    """`cells` in order, `group` a batch (0: all in one)."""
    size = group or max(1, len(cells))
    return [cells[i : i + size] for i in range(0, len(cells), size)]


def pending_cells(suite: Suite, seed: int, rerun_changed: bool, methods: list[str] | None = None) -> list[str]:
    """'partition/method' of the cells of `seed` that a run of the suite would run, in the suite's
    order, or only `methods`' in their order (an unknown seed or method: ConfigError naming the
    suite's)."""
    cells = select(suite, methods=methods, seeds=[seed])
    if methods:
        cells.sort(key=lambda c: methods.index(c.method))  # stable: each method's partitions in suite order
    return [plan.cell.cell for plan in plan_cells(suite, ROOT, cells, rerun_changed=rerun_changed) if plan.runs]


if __name__ == "__main__":
    main()
