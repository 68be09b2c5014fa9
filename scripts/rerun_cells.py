"""The cells the committed pages need run again, one line per batch: `<suite> <partition/method>,...`.

Two kinds, per suite (`suites/<name>.yaml` with `results/<name>.yaml`): the cells recorded under an
earlier config than today's (`fedskew.run.experiments.stale_cells`: their numbers are of another
config), and the cells a claim's gain needs to be paired by seed
(`fedskew.reports.report.unpaired_claim_cells`: a side recorded without per-seed values). Each batch
holds `--group` cells, in the suite's order, so that a queue that runs a batch's seeds together and
then exports it (`scripts/queue.sh`, item `rerun`) never writes a cell with part of its seeds over
one recorded with all of them.

    .venv/bin/python scripts/rerun_cells.py [--group 2] [--suites paper-mupfl,paper-map]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedskew.cli import app_defaults
from fedskew.reports.report import Evidence, load_claims, unpaired_claim_cells
from fedskew.reports.resultfile import load_all
from fedskew.run.experiments import load_suite, stale_cells

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, default=2, help="cells a line (default 2: a pair of cells keeps 2 cores busy)")
    ap.add_argument(
        "--suites", metavar="A,B", help="only these suites, in this order (default: every suite with a result file)"
    )
    args = ap.parse_args()
    if args.group < 1:
        ap.error(f"--group {args.group} is not allowed: must be 1 or more")
    defaults = app_defaults(ROOT)
    claims = unpaired_claim_cells(load_claims(ROOT / "results/claims.yaml"), Evidence(load_all(ROOT / "results")))
    have = sorted(p.stem for p in (ROOT / "results").glob("*.yaml") if (ROOT / "suites" / p.name).is_file())
    names = args.suites.split(",") if args.suites else have
    if unknown := [n for n in names if n not in have]:
        ap.error(f"--suites: no suite {unknown[0]!r} with a result file (allowed: {', '.join(have)})")
    for name in names:
        path = ROOT / "suites" / f"{name}.yaml"
        suite = load_suite(path, defaults)
        need = {*stale_cells(suite, ROOT, defaults), *claims.get(path.stem, [])}
        order = [c for c in dict.fromkeys(c.cell for c in suite.cells) if c in need]
        for i in range(0, len(order), args.group):
            print(path.stem, ",".join(order[i : i + args.group]))


if __name__ == "__main__":
    main()
