"""Benchmark: a suite's cells a minute, many runs in one process (the batched engine's grid) against
one process a cell (`suite_in_process.py --jobs J`, the Flower path's code in process).

Each way runs the same cells (a suite's slice, `--set` overrides on top, e.g. fewer rounds) into a
folder of its own, one way after the other, `--repeats` times alternating (the machine's load moves:
the ratio of a pair measured back to back is what counts), and prints for each: wall seconds, cells
a minute, and its ratio to the first way. Ways:

- `per-cell:J`: `benchmarks/suite_in_process.py --jobs J` (one process a cell, J at once, each its
  ServerApp and its clients one after the other, one torch thread);
- `grid:P`: the cells split over P processes, each running its share as many runs in one process
  (`fedskew.batched.many`), cores // P torch threads each.

    .venv/bin/python benchmarks/grid.py suites/leaderboard.yaml --partitions c2 --seeds 0 \\
        --set num-server-rounds=5 --ways per-cell:2,grid:1,grid:2 --repeats 2

Two helpers of `benchmarks/gpu_leaderboard.sh`: `grid.py stacked SUITE [METHODS]` prints the method
labels the batched engine stacks, `grid.py compare OURS.yaml REFERENCE.yaml [STAT]` compares every
cell of two result files (paired over shared seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import ROOT, in_process_setup, write_block
from suite_in_process import cell_config, parse_sets

from fedskew.resources import available_cores
from fedskew.run.experiments import labels, load_suite, select
from fedskew.run.launcher import app_defaults

SCRIPT = Path(__file__).resolve()


def grid_child(spec: str) -> None:
    """Child process: its share of the cells as many runs in this process."""
    in_process_setup()
    import torch

    from fedskew.batched.many import run_many

    job = json.loads(spec)
    torch.set_num_threads(job["threads"])
    errors = run_many(job["configs"], job["nodes"], torch.device("cpu"))
    failed = [(c["run-name"], repr(e)) for c, e in zip(job["configs"], errors, strict=True) if e is not None]
    if failed:
        raise SystemExit(f"failed: {failed}")


def run_way(way: str, args: argparse.Namespace, sets: list[str], folder: Path) -> float:
    """Run the cells one way into `folder`; its wall seconds."""
    shutil.rmtree(folder, ignore_errors=True)
    kind, _, n = way.partition(":")
    count = int(n or 1)
    t0 = time.perf_counter()
    if kind == "per-cell":
        cmd = [sys.executable, str(SCRIPT.parent / "suite_in_process.py"), args.suite, "--jobs", str(count)]
        cmd += ["--out-dir", str(folder), "--tag", "bench", "--every", "100000"]
        for flag in ("methods", "partitions", "seeds"):
            if getattr(args, flag):
                cmd += [f"--{flag}", getattr(args, flag)]
        subprocess.run([*cmd, "--set", *sets] if sets else cmd, check=True, stdout=subprocess.DEVNULL)
    elif kind == "grid":
        defaults = app_defaults(ROOT)
        suite = load_suite(args.suite, defaults)
        cells = select(suite, labels(args.methods), labels(args.partitions), labels(args.seeds, int, "--seeds"))
        batched = {**parse_sets(sets), "engine": "batched"}
        configs = [{**defaults, **cell_config(c, batched, folder)} for c in cells]
        threads = max(1, available_cores() // count)
        procs = []
        for p in range(count):
            share = configs[p::count]
            spec = json.dumps({"configs": share, "nodes": [c["num-partitions"] for c in share], "threads": threads})
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--child", spec], stdout=subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"{way}: a process failed ({codes})")
    else:
        raise SystemExit(f"--ways: {way!r} is not allowed: per-cell:J or grid:P")
    return time.perf_counter() - t0


def stacked_labels(suite_file: str, methods: str | None) -> list[str]:
    """The suite's method labels (among `methods`) whose cells the batched engine stacks."""
    from fedskew.batched.executor import stacked_refusal

    suite = load_suite(suite_file, app_defaults(ROOT))
    chosen = labels(methods) or suite.method_labels
    first = {c.method: c for c in suite.cells}
    return [m for m in chosen if stacked_refusal({**app_defaults(ROOT), **first[m].overrides}) is None]


def compare(ours_file: str, reference_file: str, stat: str) -> None:
    """Every cell of `ours_file` against the same cell of `reference_file`: the gap, paired over the
    seeds both hold (`fedskew.reports.stats`), and whether it lies within the reference's spread over seeds."""
    from fedskew.reports.resultfile import load_results, per_seed_values

    ours, ref = load_results(ours_file), load_results(reference_file)
    print(f"| cell | ours ({ours.overrides.get('device', '')}) | reference | gap, paired | within the spread |")
    print("|---|---|---|---|---|")
    inside = total = apart = 0
    for cell in ours.cells:
        other = ref.cell(cell.partition, cell.method)
        if other is None or stat not in cell.stats or stat not in other.stats:
            continue
        spread = other.stats[stat].std or 0.0
        mine, theirs = cell.stats[stat].mean, other.stats[stat].mean
        head = f"| {cell.partition}/{cell.method} | {mine:.2f} | {theirs:.2f} ± {spread:.2f}"
        if cell.rounds != other.rounds:  # another budget: nothing to compare
            apart += 1
            print(f"{head} | - | not comparable: {cell.rounds} rounds against {other.rounds} |")
            continue
        verdict, shown = within(per_seed_values(cell, stat), per_seed_values(other, stat), spread)
        inside, total = inside + verdict, total + 1
        print(f"{head} | {shown} | {'yes' if verdict else 'no'} |")
    print(f"\n{inside} of {total} cells within the reference's spread ({stat})", end="")
    print(f"; {apart} cells of another budget not compared" if apart else "")


def within(ours: dict[int, float], ref: dict[int, float], spread: float) -> tuple[bool, str]:
    """Is our cell within the reference's spread? With 2 or more shared seeds: its paired gap's
    interval holds 0 or the gap is under the reference's std over seeds; otherwise the plain gap of
    the means against that std."""
    from fedskew.reports.stats import paired_gain

    diff = float(np.mean(list(ours.values())) - np.mean(list(ref.values())))
    gap = paired_gain(ours, ref)
    if gap is not None and gap.n >= 2:
        return abs(gap.mean) <= spread or not gap.excludes_zero(), gap.text()
    seeds = f"{gap.n} shared seed" if gap is not None else "no shared seed"
    return abs(diff) <= spread, f"{diff:+.2f} ({seeds})"


def main() -> None:
    if sys.argv[1:2] == ["stacked"]:  # benchmarks/grid.py stacked SUITE [METHODS]
        print(",".join(stacked_labels(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)))
        return
    if sys.argv[1:2] == ["compare"]:  # benchmarks/grid.py compare OURS.yaml REFERENCE.yaml [STAT]
        return compare(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "global.last10")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suite", nargs="?")
    for flag in ("methods", "partitions", "seeds"):
        ap.add_argument(f"--{flag}", metavar="A,B")
    ap.add_argument("--set", nargs="*", default=[], metavar="K=V", help="run-config overrides for every cell")
    ap.add_argument("--ways", default="per-cell:2,grid:1", help="comma-separated: per-cell:J, grid:P")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-grid"))
    ap.add_argument("--doc", metavar="MD", help="also write the table, command and machine into MD's grid block")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return grid_child(args.child)
    if not args.suite:
        ap.error("the suite's YAML file is required")
    suite = load_suite(args.suite, app_defaults(ROOT))
    n = len(select(suite, labels(args.methods), labels(args.partitions), labels(args.seeds, int, "--seeds")))
    ways = args.ways.split(",")
    walls: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats):
        for way in ways:
            wall = run_way(way, args, args.set, Path(args.out) / way.replace(":", "-"))
            walls[way].append(wall)
            print(f"repeat {r + 1}: {way}: {n} cells in {wall:.0f} s ({60 * n / wall:.2f} cells a minute)", flush=True)
    first = ways[0]
    table = [
        f"| way | cells | wall (s), each repeat | cells an hour | ratio to {first} (each repeat) |",
        "|---|---|---|---|---|",
    ]
    for way in ways:
        ratios = [a / b for a, b in zip(walls[first], walls[way], strict=True)]
        rate = 3600 * n * len(walls[way]) / sum(walls[way])
        each = ", ".join(f"{w:.0f}" for w in walls[way])
        table.append(f"| {way} | {n} | {each} | {rate:.0f} | {', '.join(f'{x:.2f}' for x in ratios)} |")
    print("\n" + "\n".join(table))
    if args.doc:
        write_doc(Path(args.doc), table)


def write_doc(doc: Path, table: list[str]) -> None:
    """The table with its command and machine into `doc`'s `grid` block (atomically)."""
    command = " ".join(a for a in sys.argv[1:] if not a.startswith("--doc") and a != str(doc))
    write_block(doc, "grid", f".venv/bin/python benchmarks/grid.py {command}", table)


if __name__ == "__main__":
    main()
