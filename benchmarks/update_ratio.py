"""Diagnostic (not a timing): does `max-update-ratio` ever drop an honest reply? Reads every finished
run under the given suite folders (`metrics.jsonl`, `failures.jsonl`) and prints, per suite, partition
and method, the largest `update-ratio-max` any round logged (the largest ||w - w_sent|| /
max(||w_sent||, 1) among the accepted replies), the round it came in, and how many replies were
refused for their update size. A run's bound is its config's `max-update-ratio` (default 10).

    .venv/bin/python benchmarks/update_ratio.py outputs/suites/paper-fedrs outputs/suites/paper-map ...

With --write NOTE the table also replaces the part of NOTE between its
`<!-- report:update-ratio begin -->` and `<!-- report:update-ratio end -->` lines
(`fedskew.reports.report.replace_block`), so `docs/notes/update-ratio.md` holds this script's output, not
numbers typed by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import read_jsonl

from fedskew.config import ConfigError
from fedskew.files import write_text
from fedskew.reports.report import replace_block

REFUSED = "times the norm of the model sent"  # the reason `BaseStrategy.check_reply` gives


def run_rows(run: Path) -> tuple[float, int, int, float] | None:
    """(largest ratio, its round, refusals for the update size, the run's bound) of a finished run."""
    if not (run / "summary.json").is_file():
        return None
    ratios = [(r["update-ratio-max"], r["round"]) for r in read_jsonl(run / "metrics.jsonl") if "update-ratio-max" in r]
    if not ratios:
        return None
    refused = sum(REFUSED in f.get("reason", "") for f in read_jsonl(run / "failures.jsonl"))
    bound = json.loads((run / "config.json").read_text()).get("max-update-ratio", 10.0)
    largest, at = max(ratios)
    return largest, at, refused, bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="+", type=Path, help="suite folders (outputs/suites/<name>)")
    parser.add_argument("--write", type=Path, help="a Markdown file whose update-ratio block gets the table")
    args = parser.parse_args()
    lines = ["| suite | partition | method | runs | largest update ratio (round) | refused for size | bound |"]
    lines.append("|---|---|---|---|---|---|---|")
    overall = 0.0
    for suite in args.suites:
        cells: dict[tuple[str, str], list[tuple[float, int, int, float]]] = {}
        for run in sorted(p for p in suite.iterdir() if p.is_dir() and "--" in p.name):
            partition, method, _seed = run.name.split("--")
            if (found := run_rows(run)) is not None:
                cells.setdefault((partition, method), []).append(found)
        for (partition, method), runs in sorted(cells.items()):
            largest, at, _, bound = max(runs)
            refused = sum(r[2] for r in runs)
            overall = max(overall, largest)
            cell = f"| {suite.name} | {partition} | {method} | {len(runs)} |"
            lines.append(f"{cell} {largest:.3f} ({at}) | {refused} | {bound:g} |")
    lines += ["", f"largest ratio over every run: {overall:.3f}"]
    print("\n".join(lines))
    if args.write:
        write_block(args.write, lines)


def write_block(note: Path, lines: list[str]) -> None:
    """Replace the lines of `note` between its update-ratio markers with `lines` (whole or not at all)."""
    try:
        write_text(note, replace_block(note.read_text(), "update-ratio", lines, str(note)))
    except ConfigError as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
