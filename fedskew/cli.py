"""`fedskew` command line: argument parsing and printing; the work is in `fedskew.run.launcher`.

fedskew run [--run-config 'k=v ...'] [--num-supernodes N] [--actors A | --ray-address HOST:PORT]
            [--federation-config 'k=v'] [--resume RUN_DIR | --overwrite] [--engine flower|batched]
    Validate the config and the results folder (fails in about a second with one line: a folder
    holding an earlier run's results needs --resume or --overwrite), start a private SuperLink,
    submit the app with `flwr run`, stream its log, print the summary, stop what it started
    (also when interrupted), and exit non-zero when the run failed (`flwr run` itself exits 0
    on failed runs). The simulation trains A clients at once (default: every core busy); with
    --ray-address it joins that running Ray cluster instead (`fedskew.run.cluster`): every node busy.
    --engine batched (run-config key `engine`) runs the ServerApp and the clients in this process
    instead (`fedskew.batched`), and says whether the method's clients train as one stacked model.
fedskew experiment SUITE.yaml [--dry-run | --report | --export] [--rerun-changed] [--ray-address HOST:PORT]
    Run a suite of simulations (see `fedskew.run.experiments`); --dry-run checks every cell as a run would;
    --export writes its finished cells' numbers into results/<suite>.yaml (`fedskew.reports.resultfile`).
fedskew report [--check]
    Regenerate docs/results.md, docs/leaderboard.md, the figures and README's tables from results/
    (`fedskew.reports.report`); --check only says whether they are stale.
fedskew config
    List every run-config key with its default and meaning.
fedskew data get NAME [--data-root DIR] [--mirror URL]
    Download mnist, fashion-mnist, cifar10, cifar100 or svhn from its official host, verify every
    file's SHA-256 and unpack it where `fedskew run` looks (see `fedskew.data.download`).
fedskew data ls [--data-root DIR]
    Which data sets are present, partly downloaded or missing.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from fedskew.config import COMMON, DATASETS, ConfigError, all_params
from fedskew.data.download import DownloadError, get_dataset, list_datasets
from fedskew.files import locked
from fedskew.registry import METHODS, get_method
from fedskew.reports.resultfile import export_suite
from fedskew.run.cluster import connect, parse_address
from fedskew.run.experiments import (
    comparison,
    describe,
    labels,
    load_suite,
    plan_cells,
    run_suite,
    select,
    stale_cells,
    write_report,
)
from fedskew.run.launcher import (
    RunFailed,
    app_defaults,
    find_app_dir,
    prepare_config,
    read_overrides,
    resources_for,
    resume_overrides,
    run_simulation,
)


def format_summary(s: dict[str, Any]) -> str:
    def pct(v: Any) -> str:
        return "    n/a" if v is None else f"{100 * v:6.2f}%"

    lines = [
        f"fedskew summary: {s['method']} on {s['dataset']} ({s['partition']}, {s['num-clients']} clients, "
        f"{s['rounds']} rounds, seed {s['seed']})",
        f"  {'':<24}" + "  ".join(f"{h:>7}" for h in ("final", "best", "last-10")),
    ]
    for label, key in (
        ("global accuracy", "global_accuracy"),
        ("client-global accuracy", "client_global_accuracy"),
        ("personalized accuracy", "personalized_accuracy"),
    ):
        values = (s.get(f"final_{key}"), s.get(f"best_{key}"), s.get(f"last10_{key}"))
        lines.append(f"  {label:<24}" + "  ".join(pct(v) for v in values))
    lines += [f"  {'wall time':<24}{s['wall_seconds']:.1f} s", f"  {'results':<24}{s['run_dir']}"]
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    app_dir = find_app_dir(args.app)
    overrides, clients = read_overrides(args.run_config), args.num_supernodes or 20
    if args.overwrite:
        overrides["overwrite"] = True
    if args.resume:
        overrides, resumed_clients = resume_overrides(Path(args.resume), overrides)
        clients = args.num_supernodes or resumed_clients
    if args.engine:
        overrides["engine"] = args.engine
    cfg, overrides = prepare_config(app_dir, overrides, clients)
    if args.resume and (note := get_method(cfg["method"]).resume_note(cfg)):
        print(f"fedskew: {note}: this resumed run differs from an uninterrupted one (docs/usage.md, 'Client state')")
    with locked([Path(overrides["out-dir"]) / overrides["run-name"]]):  # no second writer in its folder
        if cfg["engine"] == "batched":
            return run_batched_cli(app_dir, cfg, overrides, clients, args)
        return run_flower(app_dir, cfg, overrides, clients, args)


def run_flower(
    app_dir: Path, cfg: dict[str, Any], overrides: dict[str, Any], clients: int, args: argparse.Namespace
) -> int:
    """`fedskew run` on Flower's simulation, here or on the Ray cluster at `--ray-address`."""
    cluster = connect(args.ray_address) if args.ray_address is not None else None
    resources = resources_for(cfg, args.actors, cluster)
    where = f" on the Ray cluster at {cluster.address}" if cluster else ""
    print(f"fedskew: {clients} clients, simulated{where} with {resources.describe()}", flush=True)
    if cluster and (note := cluster.check_room(resources)):
        print(note, flush=True)
    summary = run_simulation(app_dir, overrides, clients, args.federation_config, resources=resources, cluster=cluster)
    print(format_summary(summary), flush=True)
    return 0


def run_batched_cli(
    app_dir: Path, cfg: dict[str, Any], overrides: dict[str, Any], clients: int, args: argparse.Namespace
) -> int:
    """`fedskew run` with engine='batched': the run in this process (`fedskew.batched.grid.run_batched`)."""
    from fedskew.batched.executor import describe_engine
    from fedskew.batched.grid import run_batched

    for flag, given in (("--actors", args.actors), ("--federation-config", args.federation_config)):
        if given:
            raise ConfigError(f"{flag} is not allowed with engine='batched': it sets up Flower's simulation")
    if args.ray_address is not None:
        raise ConfigError("--ray-address is not allowed with engine='batched': the batched engine runs in this process")
    print(f"fedskew: {clients} clients, {describe_engine(cfg)}", flush=True)
    summary = run_batched({**app_defaults(app_dir), **overrides}, clients)
    print(format_summary(summary), flush=True)
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    app_dir = find_app_dir(args.app)
    suite = load_suite(args.suite, app_defaults(app_dir))
    chosen = select(
        suite, labels(args.methods), labels(args.partitions), labels(args.seeds, int, "--seeds"), labels(args.cells)
    )
    cluster = connect(args.ray_address) if args.ray_address is not None and not (args.export or args.report) else None
    if args.dry_run:  # every check a run makes, nothing started
        plans = plan_cells(suite, app_dir, chosen, args.actors, args.rerun_changed, cluster)
        for p in plans:
            note = f" ({p.note})" if p.note else ""
            print(f"{p.cell.run_name} ({p.cell.num_supernodes} clients): {p.action}{note}: {p.cell.overrides}")
        print(f"{len(chosen)} of {len(suite.cells)} cells -> {suite.folder}")
        if warning := describe(plans):
            print(warning)
        return 0
    if args.export:
        path = export_suite(suite, args.suite, app_defaults(app_dir), app_dir / "results", cells=chosen)
        print(f"exported: {path} (then `fedskew report` regenerates the docs)")
        return 0
    if args.report:
        print(comparison(suite, write_report(suite)))
    else:
        run_suite(suite, app_dir, args.stream, args.actors, chosen, args.rerun_changed, cluster)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fedskew.reports.report import main as report_main

    root = find_app_dir(None)
    defaults = app_defaults(root)
    for path in sorted((root / "suites").glob("*.yaml")):
        if (root / "results" / path.name).is_file() and (
            stale := stale_cells(load_suite(path, defaults), root, defaults)
        ):
            print(
                f"warning: results/{path.name}: {len(stale)} cells recorded under an earlier config than today's "
                f"(`fedskew experiment suites/{path.name} --rerun-changed --cells {','.join(stale)}` replaces them; "
                "`scripts/rerun_cells.py` lists every suite's)",
                file=sys.stderr,
            )
    return report_main(["--root", str(root)] + (["--check"] if args.check else []))


def cmd_config(args: argparse.Namespace) -> int:
    for key, p in all_params().items():
        allowed = f"one of {', '.join(METHODS)}" if key == "method" else p.allowed()
        print(f"{key:<26} {p.default!r:<18} {p.help} [{allowed}]")
        if key == "method":  # each registered method with its paper
            for spec in METHODS.values():
                print(f"  {spec.name:<24} {spec.paper or '(no paper given)'}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.action == "get":
        get_dataset(args.name, args.data_root, args.mirror)
    else:
        for name, state in list_datasets(args.data_root):
            print(f"{name:<14} {state}")
    return 0


ACTORS_HELP = (
    "clients trained at once (Ray actors of torch-threads threads each); default: every core busy, "
    "cores // torch-threads"
)
RAY_ADDRESS_HELP = (
    "join the running Ray cluster whose head is at HOST:PORT (as `ray start --head` prints it) instead of "
    "starting Ray here: each node runs its CPUs // torch-threads actors (docs/usage.md, 'Ray cluster')"
)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedskew", description="Label-skewed federated learning on Flower")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one federated simulation and wait for it")
    run.add_argument("--app", help="the Flower app folder (default: this checkout)")
    run.add_argument("--run-config", "-c", action="append", default=[], help="'k=v k2=\"s\"' or a TOML file")
    run.add_argument("--num-supernodes", "-n", type=int, help="number of clients (default 20)")
    start = run.add_mutually_exclusive_group()
    start.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its checkpoint.pt")
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a run folder holding an earlier run's results (they move to its aside-<time> folder)",
    )
    run.add_argument("--actors", "-j", type=int, help=ACTORS_HELP)
    run.add_argument("--ray-address", metavar="HOST:PORT", help=RAY_ADDRESS_HELP)
    run.add_argument("--engine", choices=COMMON["engine"].choices, help="the run-config key `engine` (default flower)")
    run.add_argument(
        "--federation-config",
        action="append",
        default=[],
        help="extra simulation settings, e.g. 'client-resources-num-cpus=1'",
    )
    run.set_defaults(fn=cmd_run)
    exp = sub.add_parser("experiment", help="run a YAML suite (methods x partitions x seeds), resumable")
    exp.add_argument("suite", help="the suite's YAML file")
    exp.add_argument("--app", help="the Flower app folder (default: this checkout)")
    exp.add_argument("--dry-run", action="store_true", help="validate and list the cells, run nothing")
    exp.add_argument("--report", action="store_true", help="only (re)write the table and plots")
    exp.add_argument(
        "--export",
        action="store_true",
        help="write the finished cells' numbers into results/<suite>.yaml (only those --methods, --partitions, "
        "--seeds and --cells choose; other cells there are kept)",
    )
    exp.add_argument("--stream", action="store_true", help="show each run's log")
    exp.add_argument(
        "--rerun-changed",
        action="store_true",
        help="run again the finished cells computed under another config (their earlier files are set aside)",
    )
    exp.add_argument("--actors", "-j", type=int, help=ACTORS_HELP)
    exp.add_argument("--ray-address", metavar="HOST:PORT", help=RAY_ADDRESS_HELP)
    for flag, what in (("methods", "method labels"), ("partitions", "partition labels"), ("seeds", "seeds")):
        exp.add_argument(f"--{flag}", metavar="A,B", help=f"run only these {what} (default: all the suite's)")
    exp.add_argument("--cells", metavar="P/M,P/M", help="run only these cells (partition/method labels)")
    exp.set_defaults(fn=cmd_experiment)
    rep = sub.add_parser("report", help="regenerate docs/results.md, docs/leaderboard.md and README's tables")
    rep.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated file is stale")
    rep.set_defaults(fn=cmd_report)
    conf = sub.add_parser("config", help="list every run-config key")
    conf.set_defaults(fn=cmd_config)
    data = sub.add_parser("data", help="download the standard data sets (get) or list them (ls)")
    data_sub = data.add_subparsers(dest="action", required=True)
    get = data_sub.add_parser("get", help="download, verify (SHA-256) and unpack a data set")
    get.add_argument("name", choices=DATASETS)
    get.add_argument("--mirror", help="a base URL tried before the official hosts (or $FEDSKEW_DATA_MIRROR)")
    ls = data_sub.add_parser("ls", help="which data sets are present, partly downloaded or missing")
    for p in (get, ls):
        p.add_argument("--data-root", default="data", help="where data sets go (default ./data, the run default)")
        p.set_defaults(fn=cmd_data)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # so a killed `fedskew run` still stops its SuperLink
    try:
        for flag in ("num_supernodes", "actors"):
            value = getattr(args, flag, None)
            if value is not None and value < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} {value} is not allowed: must be >= 1")
        if getattr(args, "ray_address", None) is not None:  # an empty one must not mean "run here"
            parse_address(args.ray_address)
        return int(args.fn(args))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"fedskew: config error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"fedskew: run failed: {e}", file=sys.stderr)
        return 1
    except DownloadError as e:
        print(f"fedskew: data get failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedskew: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
