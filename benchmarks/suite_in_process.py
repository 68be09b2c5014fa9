"""Benchmark: a suite's cells run in-process (no Ray, no SuperLink), several at once, under a deadline.

For a machine lent for minutes (the GPU machine: `docs/benchmarks.md`, "GPU"), where Ray is not
installed and a suite's cells must share one accelerator: each selected cell of the suite runs the
real ServerApp and ClientApp in its own process (`tests.harness.run_in_process`), `--jobs` at a
time, with the suite's config plus `--set` overrides (e.g. `model=tfcnn device=cuda`; `engine=batched`: the
batched engine, one process a cell, cores // jobs torch threads each). Every cell
writes its `metrics.jsonl` round by round into `<out-dir>/<suite>-<tag>/<cell>/`; at `--deadline`
seconds the cells still running are stopped and keep the rounds they finished. Progress every
`--every` seconds; at the end, per cell: rounds done, wall, seconds a round, the suite's last-k-round
mean of the global accuracy (over the rounds done), and the final round's. A cell folder that holds
an earlier run's results is refused (nothing is deleted): use another `--tag`, or `--set overwrite=true`.
Every `--set` is checked as the cells' run configs before anything runs (exit 2 naming the key); a
`--set` of what the cells' labels name (method, seed, the partition's keys: `Suite.identity_keys`) is
refused, as it would file one method's numbers under another's label. The chosen cells' run folders
are locked for the whole call (`fedskew.files.locked`), so a second writer (another call, `fedskew
experiment`) is refused in one line naming the holder.
`--into-suite` writes into the suite's own folder instead and does there what `fedskew experiment`
does (`plan_cells`: a finished cell is skipped, a stopped one resumed, one of another config left as
it is), so that `fedskew experiment --export` and the suite's report read its cells as their own;
unlike `fedskew experiment`, it also resumes a method whose clients keep state, from the nodes'
states its grid kept at the checkpoint's round (`fedskew.run.node_states`; not on the batched engine).
`--export-each` (with `--into-suite`) exports each cell into `results/<suite>.yaml` as soon as it
finishes, as `fedskew experiment --export` would: a long call that is cut keeps every finished cell.
`--export NAME` runs nothing and writes the finished cells of that folder into `results/NAME.yaml`
(with `--upto R`: every run's first R rounds, runs stopped at the deadline included),
checked against the suite's config plus the `--set` overrides, which the file records (e.g.
`device: cuda`), so GPU rows stand beside the suite's own CPU rows under another name. NAME is a file
stem (letters, digits, '.', '-', '_'): the file stays in `--results-dir` (default `results/`).

The in-process grid serves the same partitions and samples the same clients as `flwr run`'s
simulation, so for a seed it writes the same metrics to the last digit (`tests/test_end_to_end.py`)
and its rows compare with the suite's own.

    python3 benchmarks/suite_in_process.py suites/paper-fedrs.yaml --partitions c10-100-2 \
        --methods fedavg,fedrs-0.5 --seeds 0,1,2 --set model=tfcnn device=cuda --jobs 6 --deadline 480
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import yaml
from _common import ROOT, in_process_setup

from fedskew.config import ConfigError, validate
from fedskew.files import locked
from fedskew.reports.resultfile import check_result_name, export_suite, failed_round
from fedskew.resources import available_cores
from fedskew.run.experiments import Cell, Suite, labels, load_suite, plan_cells, select
from fedskew.run.launcher import app_defaults
from fedskew.server_app.results import read_jsonl, round_statistics


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2: a refused option, config or folder (as `fedskew`'s)."""
    print(f"suite_in_process.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`k=v` pairs, each value read as YAML (`0.5` a float, `cuda` a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--set {item!r}: expected key=value")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            fail(f"--set {item!r}: the value is not a YAML scalar")
    return out


def check_sets(suite: Suite, cells: list[Cell], sets: dict[str, Any], folder: Path) -> None:
    """Refuse (`fail`) a `--set` of a key the cells' labels name (`Suite.identity_keys`: its runs would
    be filed, and exported, under labels that do not name them), then any cell whose run config
    with the `--set` ones is not valid: before anything runs, not in each child after it started."""
    if named := sorted(set(sets) & suite.identity_keys):
        fail(
            f"--set {named[0]}={sets[named[0]]!r} is not allowed: {named[0]} is what the cells' labels name "
            "(method, seed, the partition's keys and the methods' own keys their labels set); choose cells with "
            "--methods/--partitions/--seeds, or write a suite whose labels name that config"
        )
    defaults = app_defaults(ROOT)
    for cell in cells:
        try:
            validate({**defaults, **cell_config(cell, sets, folder)})
        except ConfigError as e:
            fail(f"--set: cell {cell.run_name}: {e}")


def rounds_done(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def cell_stats(run_dir: Path, last: int) -> dict[str, Any]:
    """Rounds done, the mean global accuracy (%) of the last `last` of them and of the final one
    (`round_statistics`, as the suite's tables), and the median seconds a round took
    (`timings.jsonl`: the round from sending to aggregating)."""
    rows = rounds_done(run_dir)
    stats = round_statistics(rows, last)
    times = run_dir / "timings.jsonl"
    seconds = sorted(t["seconds"] for t in read_jsonl(times)) if times.is_file() else []
    percent = {k: stats[f"{k}_global_accuracy"] for k in (f"last{last}", "final")}
    return {
        "rounds": len(rows),
        **{k: None if v is None else 100 * v for k, v in percent.items()},
        "round-seconds": seconds[len(seconds) // 2] if seconds else None,
    }


def cell_config(cell: Cell, sets: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The overrides of `cell` run into `folder` with the `--set` ones on top."""
    cfg = {**cell.overrides, **sets, "out-dir": str(folder), "run-name": cell.run_name}
    cfg["num-partitions"] = cell.num_supernodes  # as `fedskew run` saves it
    return cfg


def run_one(spec: str) -> None:
    """Child process: one cell, in-process: on the batched engine where its config says
    `engine: batched` (`fedskew.batched.grid.run_batched`, `threads` torch threads), else the
    per-client in-process grid; several cells (`--together`): as many runs in this process
    (`fedskew.batched.many`), their clients stacked together."""
    in_process_setup()
    job = json.loads(spec)
    if "cfgs" in job:
        import torch

        from fedskew.batched.many import run_many
        from fedskew.training import pick_device

        torch.set_num_threads(job["threads"])
        cfgs = [{**app_defaults(ROOT), **cfg} for cfg in job["cfgs"]]
        errors = run_many(cfgs, job["nodes"], pick_device(str(cfgs[0]["device"])))
        for cfg, error in zip(cfgs, errors, strict=True):
            if error is not None:
                print(f"{cfg['run-name']}: failed: {type(error).__name__}: {error}", flush=True)
        raise SystemExit(1 if any(errors) else 0)
    if job["cfg"].get("engine") == "batched":
        from fedskew.batched.grid import run_batched

        run_batched({**app_defaults(ROOT), **job["cfg"]}, job["nodes"], quiet=True, threads=job["threads"])
        return
    from tests.harness import run_in_process

    run_in_process(job["cfg"], job["nodes"], keep_node_states=True)


def start(group: list[tuple[Cell, dict[str, Any]]], folder: Path, threads: int) -> subprocess.Popen:
    """A child process for one cell, or for a group of cells run together (`--together`), its log
    in the first cell's folder (`run.log`)."""
    for cell, _ in group:
        (folder / cell.run_name).mkdir(parents=True, exist_ok=True)
    run_dir = folder / group[0][0].run_name
    if len(group) == 1:
        cell, cfg = group[0]
        spec = json.dumps({"cfg": cfg, "nodes": cell.num_supernodes, "threads": threads})
    else:
        cfgs, nodes = [cfg for _, cfg in group], [cell.num_supernodes for cell, _ in group]
        spec = json.dumps({"cfgs": cfgs, "nodes": nodes, "threads": threads})
    with open(run_dir / "run.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, __file__, "--one", spec], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every cell's process group at once, then SIGKILL those still running `grace` seconds
    later: one grace for all, where stopping them one after the other could take a grace each (on a
    GPU machine lent for minutes, n cells that ignore SIGTERM would hold the command n x 10 s)."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):  # ended since it was polled
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    for proc in live:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def export_finished(suite_file: str, suite: Suite, cells: list[Cell], results: Path) -> None:
    """`--export-each`: write `cells` (just finished) into `results`/<suite>.yaml, saying so; a failed
    export is said, and the other cells run on (`fedskew experiment --export` can write them later)."""
    try:
        path = export_suite(suite, suite_file, app_defaults(ROOT), results, cells=cells)
    except (ConfigError, OSError, ValueError) as e:
        print(f"{', '.join(c.run_name for c in cells)}: not exported: {type(e).__name__}: {e}", flush=True)
        return
    print(f"{', '.join(c.run_name for c in cells)}: exported into {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suite", nargs="?", help="the suite's YAML file")
    for flag in ("methods", "partitions", "seeds"):
        ap.add_argument(f"--{flag}", metavar="A,B", help=f"only these {flag} (default: all the suite's)")
    ap.add_argument("--cells", metavar="P/M,P/M", help="only these cells (partition/method labels)")
    ap.add_argument("--set", nargs="*", default=[], metavar="K=V", help="run-config overrides for every cell")
    ap.add_argument("--jobs", type=int, default=1, help="cells at once, each its own process (1 or more)")
    ap.add_argument(
        "--together",
        type=int,
        default=1,
        metavar="N",
        help="engine=batched: N cells a process, run together, their clients stacked across cells "
        "(fedskew.batched.many); --jobs such processes at once",
    )
    ap.add_argument("--deadline", type=float, default=0.0, help="stop running cells after this many s (0: none)")
    ap.add_argument("--tag", default="in-process", help="the output folder is <out-dir>/<suite>-<tag>")
    ap.add_argument("--out-dir", help="default: the suite's out-dir")
    ap.add_argument(
        "--into-suite",
        action="store_true",
        help="write into the suite's own folder, skipping finished cells and resuming stopped ones as "
        "`fedskew experiment` does (no --set, --tag or --out-dir)",
    )
    ap.add_argument(
        "--rerun-changed",
        action="store_true",
        help="with --into-suite: run again a finished cell whose config has changed (its earlier files set aside)",
    )
    ap.add_argument(
        "--export-each",
        action="store_true",
        help="with --into-suite: export each cell into results/<suite>.yaml as soon as it finishes (as "
        "`fedskew experiment --export` would), so that a long call loses no finished cell",
    )
    ap.add_argument("--results-dir", default=str(ROOT / "results"), help="where --export and --export-each write")
    ap.add_argument("--every", type=float, default=30.0, help="progress every this many s")
    ap.add_argument(
        "--export",
        metavar="NAME",
        help="run nothing: write the finished cells of <out-dir>/<suite>-<tag> into results/NAME.yaml (NAME: a "
        "file stem), their config the suite's plus --set (recorded as the file's overrides)",
    )
    ap.add_argument(
        "--upto",
        type=int,
        default=0,
        metavar="R",
        help="with --export: every run's first R rounds, runs stopped part-way included (rounds all reached)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args.one)
    if not args.suite:
        ap.error("the suite's YAML file is required")
    if args.upto and not args.export:
        ap.error("--upto R is for --export (which rounds of the runs to write)")
    if args.jobs < 1:  # no cell would ever start, and the loop would wait for them forever
        fail(f"--jobs {args.jobs} is not allowed: must be 1 or more (cells at once)")
    sets = parse_sets(args.set)
    try:
        if args.export is not None:
            check_result_name(args.export)
        suite = load_suite(args.suite, app_defaults(ROOT))
        cells = select(
            suite, labels(args.methods), labels(args.partitions), labels(args.seeds, int, "--seeds"), labels(args.cells)
        )
    except ConfigError as e:
        fail(str(e))
    folder = Path(args.out_dir or suite.out_dir).absolute() / f"{suite.name}-{args.tag}"
    if args.into_suite:
        if sets or args.out_dir or args.tag != ap.get_default("tag") or args.export:
            ap.error("--into-suite runs the suite's own cells: no --set, --tag, --out-dir or --export")
        folder = suite.folder.absolute()
    elif args.export_each:
        ap.error("--export-each is for --into-suite (a suite's own cells go into its result file)")
    check_sets(suite, cells, sets, folder)
    if args.export:
        if args.upto < 0:
            ap.error(f"--upto {args.upto}: must be a number of rounds, 1 or more (0: finished runs only)")
        command = f"`benchmarks/suite_in_process.py {args.suite} --set {' '.join(args.set)}`"
        defaults, results = app_defaults(ROOT), Path(args.results_dir)
        try:
            path = export_suite(
                suite,
                args.suite,
                defaults,
                results,
                runs=folder,
                overrides=sets,
                name=args.export,
                source=command,
                upto=args.upto,
                cells=cells,
            )
        except ConfigError as e:
            fail(str(e))
        print(f"wrote {path}")
        return
    try:
        with locked([folder / cell.run_name for cell in cells]):  # no second writer in these run folders
            run_cells(args, suite, cells, sets, folder)
    except ConfigError as e:
        fail(str(e))


def run_cells(args: argparse.Namespace, suite: Suite, cells: list[Cell], sets: dict[str, Any], folder: Path) -> None:
    """Plan (`--into-suite`) and run the chosen cells `--jobs` at a time up to `--deadline`, then print
    their table: under the locks of their run folders."""
    if args.into_suite:
        plans = plan_cells(suite, ROOT, cells, rerun_changed=args.rerun_changed, node_states=True)
        for plan in plans:
            if plan.action != "run":
                print(f"{plan.cell.run_name}: {plan.action}{f' ({plan.note})' if plan.note else ''}", flush=True)
        todo = [(plan.cell, plan.overrides) for plan in plans if plan.runs]
        cells = [cell for cell, _ in todo]
    else:
        todo = [(cell, cell_config(cell, sets, folder)) for cell in cells]
    if args.together < 1:
        fail(f"--together {args.together} is not allowed: must be 1 or more (cells a process)")
    if args.together > 1 and any(validate({**app_defaults(ROOT), **cfg})["engine"] != "batched" for _, cfg in todo):
        fail("--together runs cells on the batched engine: give --set engine=batched (or a suite of batched cells)")
    groups = [todo[i : i + args.together] for i in range(0, len(todo), args.together)]
    together = f", {args.together} a process" if args.together > 1 else ""
    print(f"{len(todo)} cells of {suite.name}{together}, {args.jobs} at once, overrides {sets} -> {folder}", flush=True)
    t0 = time.perf_counter()
    running: dict[str, tuple[subprocess.Popen, float]] = {}  # run name -> (process, start)
    members: dict[str, list[str]] = {}  # a process's first run name -> every run name it runs
    ended: dict[str, float] = {}  # run name -> wall seconds
    next_report = args.every
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the cells
    try:
        while groups or running:
            while groups and len(running) < args.jobs:
                group = groups.pop(0)
                threads = max(1, available_cores() // args.jobs)  # the batched engine's torch threads
                name = group[0][0].run_name
                members[name] = [cell.run_name for cell, _ in group]
                running[name] = (start(group, folder, threads), time.perf_counter())
            time.sleep(1.0)
            now = time.perf_counter() - t0
            for name, (proc, began) in list(running.items()):
                if proc.poll() is not None:
                    ended.update({member: time.perf_counter() - began for member in members[name]})
                    del running[name]
                    finished = [c for c in cells if c.run_name in members[name]]
                    stops = {c.run_name: failed_round(folder / c.run_name) for c in finished}
                    if proc.returncode:
                        print(f"{name}: exit {proc.returncode}, see its run.log", flush=True)
                        for member, r in stops.items():  # a stop is a result: counted, not retried here
                            if r is not None:
                                print(f"{member}: stopped at round {r} (stopped.json), counted over the rounds before")
                    if args.export_each and (not proc.returncode or all(r is not None for r in stops.values())):
                        export_finished(args.suite, suite, finished, Path(args.results_dir))
            if args.deadline and now >= args.deadline:
                stop([proc for proc, _ in running.values()])
                for name, (_, began) in running.items():
                    ended.update({member: time.perf_counter() - began for member in members[name]})
                left = sum(len(g) for g in groups)
                print(f"deadline {args.deadline:.0f} s: stopped {len(running)} running, {left} cells not started")
                running, groups = {}, []
            if now >= next_report:
                next_report += args.every
                done = {m: len(rounds_done(folder / m)) for name in running for m in members[name]}
                print(f"{now:6.0f} s: rounds done {done}", flush=True)
    finally:  # interrupted (Ctrl-C, SIGTERM): the cells run in their own sessions, so stop them here
        stop([proc for proc, _ in running.values()])
    print(f"| cell | rounds | wall (s) | median s a round | last {suite.last_rounds} rounds (%) | final (%) |")
    print("|---|---|---|---|---|---|")
    for cell in cells:
        if cell.run_name not in ended:
            continue
        s = cell_stats(folder / cell.run_name, suite.last_rounds)
        keys = ("round-seconds", f"last{suite.last_rounds}", "final")
        cols = [f"{s[k]:.2f}" if s[k] is not None else "-" for k in keys]
        print(f"| {cell.run_name} | {s['rounds']} | {ended[cell.run_name]:.0f} | {' | '.join(cols)} |")


if __name__ == "__main__":
    main()
