"""Diagnostic (not a timing): would `update-norm-bound` clip an honest client? Runs short honest
protocols in this process (the real ServerApp and ClientApp, `tests.harness.InProcessGrid`) with the
bound off, so that they are the reference runs, and prints per protocol the largest ratio, over its
rounds, of an accepted update's norm to its round's median (`update-norm-ratio-max` in
`metrics.jsonl`), the same ratio of the uploaded statistics (`prototype-norm-ratio-max`,
`class-gradient-norm-ratio-max`) and the round it came in. The default bound clips nothing on a
protocol whose largest ratio stays under it; a run with the bound at its default then equals the
run without it bit for bit (`BaseStrategy.bound_updates` rewrites nothing that is within it).

    .venv/bin/python benchmarks/update_norm.py [--protocols fedavg-dir01,...] [--rounds 5] [--out DIR]
    .venv/bin/python benchmarks/update_norm.py --read DIR [DIR ...]     # tables of earlier runs
    .venv/bin/python benchmarks/update_norm.py --read DIR --clipped-only --against OFF --block NAME

--clipped-only keeps the runs that clipped or dropped something; --against OFF adds each run's last-10
global and personalized accuracy beside those of the run of the same name under OFF (the same cell
run again with the bounds off): what the clips moved.

With --write NOTE the table also replaces the part of NOTE between its `<!-- report:<block>
begin -->` and `<!-- report:<block> end -->` lines (--block, default update-norm), so
`docs/notes/update-ratio.md` holds this script's output, not numbers typed by hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from _common import in_process_setup, read_jsonl, run_config

from fedskew.config import ConfigError
from fedskew.files import atomic_write
from fedskew.reports.report import replace_block
from fedskew.server_app.app import main as server_main
from fedskew.server_app.results import round_statistics

# Fashion-MNIST, LeNet, 20 partitions with 10 clients a round: the label skews of the papers'
# protocols (FedGELA's Dirichlet 0.1 with 5 local epochs of batch 100, FedRS's 2 classes a client,
# MAP's log-normal sizes, MuPFL's long tail x Dirichlet 0.5) and the methods whose server state or
# statistics are built from the uploads.
BASE = {"model": "lenet", "fraction-train": 0.5, "local-epochs": 2}
DIR01 = {"partition": "dirichlet", "dirichlet-alpha": 0.1}
TWO = {"partition": "classes-per-client", "classes-per-client": 2, "classes-per-client-mode": "shards"}
LONG_TAIL = {"partition": "long-tail", "imbalance-factor": 10.0, "dirichlet-alpha": 0.5}
PROTOCOLS: dict[str, dict[str, Any]] = {
    "fedavg-dir01-e5": {"method": "fedavg", **DIR01, "local-epochs": 5, "batch-size": 100},
    "fedavg-2class": {"method": "fedavg", **TWO},
    "fedavg-map-random": {"method": "fedavg", "partition": "map-random"},
    "fedavg-long-tail": {"method": "fedavg", **LONG_TAIL},
    "scaffold-2class": {"method": "scaffold", **TWO},
    "feddyn-dir01": {"method": "feddyn", **DIR01},
    "feddc-2class": {"method": "feddc", **TWO},
    "fednova-dir01": {"method": "fednova", **DIR01},
    "fedproto-dir01": {"method": "fedproto", **DIR01},
    "fedproc-2class": {"method": "fedproc", **TWO},
    "fedmr-2class": {"method": "fedmr", **TWO},
    "creff-long-tail": {"method": "creff", **LONG_TAIL, "creff-match-iters": 20, "creff-retrain-epochs": 20},
    "mupfl-long-tail": {"method": "mupfl", **LONG_TAIL, "mupfl-match-iters": 20, "mupfl-tau": 5},
}
RATIOS = {
    "update": "update-norm-ratio-max",
    "prototype": "prototype-norm-ratio-max",
    "gradient": "class-gradient-norm-ratio-max",
}
CLIPPED = ("update-clipped", "prototype-dropped", "class-gradient-dropped")


def run_protocol(name: str, overrides: dict[str, Any], rounds: int, clients: int, out: Path) -> None:
    """One honest in-process run of `overrides` with the bound off, into `out/<name>`."""
    from tests.harness import InProcessGrid

    rc = run_config(
        **{**BASE, **overrides},
        **{"num-server-rounds": rounds, "eval-every": rounds, "tensorboard": False},
        **{"update-norm-bound": 0.0, "statistic-norm-bound": 0.0},
        **{"out-dir": str(out), "run-name": name, "overwrite": True},
    )
    from flwr.app import Context, RecordDict

    grid = InProcessGrid(clients, rc)
    server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


def _pair(a: float | None, b: float | None) -> str:
    """'a / b (a - b)' of two last-10 accuracies (fractions) in percent; '-' without either."""
    return "-" if a is None or b is None else f"{100 * a:.2f} / {100 * b:.2f} ({100 * (a - b):+.2f})"


def run_row(run: Path, against: Path | None = None) -> tuple[str, ...] | None:
    """The table cells of a finished run: its largest ratio of each kind (round), its clips, its bound
    and, with `against`, its last-10 accuracies beside those of the same-named run there."""
    if not (run / "summary.json").is_file():
        return None
    rows = read_jsonl(run / "metrics.jsonl")
    cells = []
    for key in RATIOS.values():
        found = [(r[key], r["round"]) for r in rows if r.get(key)]
        cells.append(f"{max(found)[0]:.3f} ({max(found)[1]})" if found else "-")
    clipped = sum(int(r.get(k, 0)) for r in rows for k in CLIPPED)
    cfg = json.loads((run / "config.json").read_text())
    bounds = f"{cfg.get('update-norm-bound', 0):g} / {cfg.get('statistic-norm-bound', 0):g}"
    out = (run.name, str(len(rows)), *cells, str(clipped), bounds)
    if against is None:
        return out
    off = against / run.name
    if not (off / "summary.json").is_file():
        return (*out, "-", "-")
    mine, theirs = round_statistics(rows, 10), round_statistics(read_jsonl(off / "metrics.jsonl"), 10)
    return (*out, *(_pair(mine[k], theirs[k]) for k in ("last10_global_accuracy", "last10_personalized_accuracy")))


def table(runs: list[Path], against: Path | None = None, clipped_only: bool = False) -> tuple[list[str], float]:
    head = "| run | rounds | largest update / median (round) | prototype / median | class gradient / median "
    head += "| clipped or dropped | bounds |"
    if against is not None:
        head += " global last-10, bound / off (%) | personalized last-10, bound / off (%) |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    overall = 0.0
    for run in runs:
        if (row := run_row(run, against)) is None or (clipped_only and row[5] == "0"):
            continue
        lines.append("| " + " | ".join(row) + " |")
        overall = max([overall] + [float(c.split()[0]) for c in row[2:5] if c != "-"])
    return [*lines, "", f"largest ratio over every run: {overall:.3f}"], overall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma-separated names of PROTOCOLS")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("outputs/update-norm"))
    parser.add_argument("--read", type=Path, nargs="*", help="only tabulate these run folders (or their parents)")
    parser.add_argument("--write", type=Path, help="a Markdown file whose update-norm block gets the table")
    parser.add_argument("--block", default="update-norm", help="the block of --write (default update-norm)")
    parser.add_argument("--against", type=Path, help="with --read: the same runs with the bounds off")
    parser.add_argument("--clipped-only", action="store_true", help="only the runs that clipped or dropped")
    args = parser.parse_args()
    if args.read is None:
        in_process_setup()
        logging.getLogger("fedskew").setLevel(logging.WARNING)
        names = [n for n in args.protocols.split(",") if n]
        unknown = [n for n in names if n not in PROTOCOLS]
        if unknown:
            raise SystemExit(f"unknown protocols {unknown}: choose from {', '.join(PROTOCOLS)}")
        for name in names:
            t0 = time.perf_counter()
            run_protocol(name, PROTOCOLS[name], args.rounds, args.clients, args.out)
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        runs = [args.out / n for n in names]
    else:
        runs = [r for p in args.read for r in ([p] if (p / "metrics.jsonl").is_file() else sorted(p.iterdir()))]
    lines, _ = table(runs, args.against, args.clipped_only)
    print("\n".join(lines))
    if args.write:
        try:
            text = replace_block(args.write.read_text(), args.block, lines, str(args.write))
        except ConfigError as e:
            raise SystemExit(str(e)) from None
        atomic_write(args.write, lambda f: f.write(text.encode()))


if __name__ == "__main__":
    main()
