"""Experiment suites: a YAML grid of methods x partitions x seeds, run cell by cell as simulations.

    fedskew experiment suites/fmnist-pcdd.yaml [--dry-run] [--methods A,B] [--partitions X] [--seeds 0,1]

Suite file::

    name: fmnist-pcdd                 # folder under out-dir (default: the file's stem)
    num-supernodes: 20                # clients per run
    seeds: [0, 1, 2]
    out-dir: outputs/suites           # default
    last-rounds: 10                   # the tables' "last k rounds" mean (FedRS reports k = 50)
    base: {num-server-rounds: 30}     # run config shared by every cell
    methods:                          # label -> overrides; `method` defaults to the label
      fedavg: {}
      fedrs-0.5: {method: fedrs, fedrs-alpha: 0.5}
    partitions:                       # label -> overrides (may set its own num-supernodes, seeds)
      c2: {partition: classes-per-client, classes-per-client: 2}
      p5c2: {partition: classes-per-client, classes-per-client: 2, num-supernodes: 5}
      dir01: {partition: dirichlet, dirichlet-alpha: 0.1, seeds: [0, 1, 2, 3, 4]}

The name and every label are single folder names. Before anything runs, every chosen cell is
checked as its run would check it (`plan_cells`; `--dry-run` stops there) and given its action
(each in full: docs/notes/suites.md):

- done: finished (`summary.json`) under the cell's config (`config.json`): skipped;
- changed: finished under another config or another revision of its method
  (`MethodSpec.revision`): kept and named in a warning; `--rerun-changed` runs it again, its
  earlier files set aside in `aside-<time>-*/`;
- resume: stopped part-way with the cell's config: continues from its `checkpoint.pt`;
- afresh: stopped part-way otherwise, or of a method whose clients keep state across rounds
  (`MethodSpec.resume_note`): runs again, its earlier files set aside (never deleted);
- recorded: nothing there, but this seed of this cell is in `results/<name>.yaml` under the same
  config (`fedskew.reports.resultfile.config_sha256`): skipped;
- run: nothing there yet.

`--methods`, `--partitions` and `--seeds` run only the cells with those labels, `--cells P/M,...`
only those cells (`select`). A cell whose config sets `engine: batched` runs in this process
(`fedskew.batched.grid.run_batched`); the others share one private SuperLink (and Ray head), started
only if there are any. At the end (and
with `--report`) the suite folder gets `results.md`, `results.csv`, `accuracy-<partition>.png` and
`per-class-<partition>.png`, each written whole or not at all (`fedskew.reports.markdown.md`).

A suite run holds the lock of every chosen cell's run folder from before it plans them to its end
(`fedskew.files.locked`): a second writer is refused in one line naming the holder. A run folder
whose rounds are not 1..R in order is refused by the report and the export (`resultfile.read_rounds`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedskew.config import COMMON, ConfigError, all_params, folder_name_rule, validate
from fedskew.data.clients import PARTITION_KEYS as client_partition_keys
from fedskew.data.clients import client_indices, partition_key
from fedskew.diagnostics import last_rounds_per_class
from fedskew.files import atomic_write, check_folder, locked, write_text
from fedskew.partitions import PartitionError
from fedskew.registry import get_method
from fedskew.reports.markdown import md
from fedskew.reports.resultfile import Stat, config_sha256, load_results, read_rounds, suite_config, suite_seeds
from fedskew.run.cluster import RayCluster
from fedskew.run.launcher import RunFailed, app_defaults, prepare_config, resources_for, run_simulation, simulation_link
from fedskew.run.node_states import load_node_states
from fedskew.server_app.results import LAST_ROUNDS, RESULTS, round_statistics, run_seconds, saved_changes

SUITE_KEYS = {"name", "num-supernodes", "seeds", "out-dir", "base", "methods", "partitions", "last-rounds"}
# the run-config keys that decide which data a cell's clients hold (the partition's, where the data lives
# aside, and the number of clients): with `method` and `seed`, what a cell's labels name (`Suite.identity_keys`)
PARTITION_KEYS = (*(k for k in client_partition_keys if k != "data-root"), "num-partitions")


def run_name(partition: str, method: str, seed: int) -> str:
    """A cell's run folder in its suite's folder: `<partition>--<method>--s<seed>`."""
    return f"{partition}--{method}--s{seed}"


@dataclass(frozen=True)
class Cell:
    method: str  # label
    partition: str  # label
    seed: int
    overrides: dict[str, Any]
    num_supernodes: int

    @property
    def run_name(self) -> str:
        return run_name(self.partition, self.method, self.seed)

    @property
    def cell(self) -> str:
        """'partition/method': the cell over its seeds, as `--cells` and the result files name it."""
        return f"{self.partition}/{self.method}"


@dataclass
class Suite:
    name: str
    out_dir: Path
    cells: list[Cell]
    method_labels: list[str]
    partition_labels: list[str]
    last_rounds: int = LAST_ROUNDS
    method_keys: frozenset[str] = frozenset()  # the method-specific keys its method labels set

    @property
    def folder(self) -> Path:
        return self.out_dir / self.name

    @property
    def identity_keys(self) -> frozenset[str]:
        """The run-config keys a cell's labels stand for: its method (and the method's own keys its
        label sets, e.g. `fedrs-alpha` of `fedrs-0.5`), its partition and its seed. An override of one
        of them for every cell (`suite_in_process.py --set`) would file a run under a label that does
        not name it."""
        return frozenset({"method", "seed", *PARTITION_KEYS}) | self.method_keys

    def run_folders(self, cells: list[Cell] | None = None) -> list[Path]:
        """The run folders of `cells` (default: all), whose locks a suite run holds."""
        return [self.folder / c.run_name for c in (self.cells if cells is None else cells)]


def _mapping(raw: Any, where: str, config: bool = False) -> dict[str, Any]:
    """`raw` as a mapping ({} for None); with `config`, a run config whose keys must be strings."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping (key: value), got {type(raw).__name__}")
    bad = [k for k in raw if config and not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where}: key {bad[0]!r} is not a run-config key (a {type(bad[0]).__name__})")
    return raw


def _folder_name(value: Any, where: str) -> str:
    """A suite's name or label: one folder name (its results stay inside out-dir)."""
    if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "":
        raise ConfigError(f"{where}={value!r} is not allowed: must be a non-empty folder name")
    try:
        folder_name_rule(str(value), {})
    except ValueError as e:
        raise ConfigError(f"{where}={value!r} is not allowed: {e}") from None
    return str(value)


def load_suite(path: str | Path, app_defaults: dict[str, Any]) -> Suite:
    """Parse and validate a suite file; raises ConfigError naming the file, the key and the problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such suite file")
    try:
        raw = _mapping(yaml.safe_load(path.read_text()), str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    unknown = set(raw) - SUITE_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(SUITE_KEYS))})")
    _seed_list(raw.get("seeds", [0]), str(path))  # checked here, each partition's list by suite_seeds
    n = _num_supernodes(raw.get("num-supernodes", 20), str(path))
    name = _folder_name(raw.get("name", path.stem), f"{path}: name")
    out_dir = raw.get("out-dir", "outputs/suites")
    if not isinstance(out_dir, str):
        raise ConfigError(f"{path}: out-dir={out_dir!r} is not allowed: must be a folder path")
    out_dir = Path(out_dir).expanduser().absolute()
    check_folder(out_dir / name, f"{path}: out-dir")
    _mapping(raw.get("base"), f"{path}: base", config=True)  # checked here, composed by suite_config
    methods = _mapping(raw.get("methods"), f"{path}: methods") or {"fedavg": {}}
    partitions = _mapping(raw.get("partitions"), f"{path}: partitions") or {"default": {}}
    for kind, table in (("methods", methods), ("partitions", partitions)):
        for label in table:
            _folder_name(label, f"{path}: {kind} label")
    cells = []
    possible: set[tuple] = set()
    for p_label, p_raw in partitions.items():
        p_over = dict(_mapping(p_raw, f"{path}: partitions.{p_label}", config=True))
        p_n = _num_supernodes(p_over.pop("num-supernodes", n), f"{path}: partitions.{p_label}")
        p_seeds = _seed_list(suite_seeds(raw, p_label), f"{path}: partitions.{p_label}")
        for m_label, m_over in methods.items():
            _mapping(m_over, f"{path}: methods.{m_label}", config=True)
            for seed in p_seeds:
                over = {**suite_config(raw, p_label, m_label), "seed": seed}
                try:
                    cfg = validate({**app_defaults, **over})
                    if (partition_key(cfg), p_n) not in possible:  # each partition checked once, not per method
                        client_indices(cfg, p_n)  # the partition must be possible
                        possible.add((partition_key(cfg), p_n))
                except (ConfigError, PartitionError, FileNotFoundError) as e:
                    raise ConfigError(f"{path}: cell {p_label}/{m_label}/seed {seed}: {e}") from None
                cells.append(Cell(str(m_label), str(p_label), seed, over, p_n))
    last = raw.get("last-rounds", LAST_ROUNDS)
    if not isinstance(last, int) or isinstance(last, bool) or last < 1:
        raise ConfigError(f"{path}: last-rounds={last!r} must be a positive integer")
    own = set(all_params()) - set(COMMON)  # the keys of some method
    method_keys = frozenset(k for m in methods.values() for k in (m or {}) if k in own)
    return Suite(name, out_dir, cells, list(map(str, methods)), list(map(str, partitions)), last, method_keys)


def _seed_list(value: Any, where: str) -> list[int]:
    """A suite's (or one partition's) seeds: a non-empty list of distinct non-negative integers."""
    ok = isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    if not ok or min(value) < 0 or len(set(value)) != len(value):
        raise ConfigError(f"{where}: seeds={value!r} must be a non-empty list of distinct non-negative integers")
    return list(value)


def _num_supernodes(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: num-supernodes={value!r} must be a positive integer")
    return value


def labels(text: str | None, kind: type = str, flag: str = "") -> list | None:
    """'a,b' -> ['a', 'b'] (None when not given), for `select`; `kind=int` for seeds, with the flag
    in the error."""
    if text is None:
        return None
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not allowed: give integers separated by commas") from None


def select(
    suite: Suite,
    methods: list[str] | None = None,
    partitions: list[str] | None = None,
    seeds: list[int] | None = None,
    cells: list[str] | None = None,
) -> list[Cell]:
    """The suite's cells whose method, partition and seed are among those given (None: all), and
    whose 'partition/method' is in `cells` when given (cells that are not a whole row or column); an
    unknown label, seed or cell raises ConfigError naming it and what the suite has."""
    have = {
        "method": suite.method_labels,
        "partition": suite.partition_labels,
        "seed": sorted({c.seed for c in suite.cells}),
        "cell": list(dict.fromkeys(c.cell for c in suite.cells)),
    }
    wanted = {"method": methods, "partition": partitions, "seed": seeds, "cell": cells}
    for kind, values in wanted.items():
        for v in values or []:
            if v not in have[kind]:
                allowed = ", ".join(map(str, have[kind])) if kind != "cell" else f"{have[kind][0]}, ... (P/M)"
                raise ConfigError(f"suite {suite.name}: no {kind} {v!r} (it has: {allowed})")
    return [c for c in suite.cells if all(not values or getattr(c, kind) in values for kind, values in wanted.items())]


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclass(frozen=True)
class CellPlan:
    """What a suite run does with one cell (see the module docstring), with the overrides it
    submits and the reason of a `changed` or `afresh` action."""

    cell: Cell
    action: str  # done, changed, rerun, resume, afresh, recorded or run
    overrides: dict[str, Any]
    note: str = ""

    @property
    def runs(self) -> bool:
        return self.action not in ("done", "changed", "recorded")


def plan_cells(
    suite: Suite,
    app_dir: Path,
    cells: list[Cell] | None = None,
    actors: int | None = None,
    rerun_changed: bool = False,
    cluster: RayCluster | None = None,
    node_states: bool = False,
) -> list[CellPlan]:
    """Check each cell (default: all the suite's) as its run would (`prepare_config`: config, data,
    device, results folder, checkpoint; `resources_for`: actors, here or on `cluster`) and decide its
    action from what its folder holds. `node_states`: the engine puts back the nodes' states a
    stopped run kept (`fedskew.run.node_states`), so a method whose clients keep state resumes where
    they are kept. Raises ConfigError naming the first cell a run would refuse."""
    plans = []
    recorded = recorded_seeds(suite, app_dir)
    for cell in suite.cells if cells is None else cells:
        run_dir = suite.folder / cell.run_name
        over = {**cell.overrides, "out-dir": str(suite.folder), "run-name": cell.run_name}
        try:
            cfg, subm = prepare_config(app_dir, {**over, "overwrite": True}, cell.num_supernodes)
            resources_for(cfg, actors, cluster)
            plan = _plan(cell, run_dir, cfg, subm, app_dir, rerun_changed, node_states)
        except (ConfigError, PartitionError, FileNotFoundError) as e:
            raise ConfigError(f"suite {suite.name}: cell {cell.run_name}: {e}") from None
        sha, missing = recorded.get((cell.partition, cell.method, cell.seed), (None, ()))
        if plan.action == "run" and sha is not None and sha == config_sha256(cfg):
            lacks = f" (without {', '.join(missing)}: a metric added since)" if missing else ""
            plan = CellPlan(cell, "recorded", {}, f"in results/{suite.name}.yaml{lacks}")
        plans.append(plan)
    return plans


def recorded_seeds(suite: Suite, app_dir: Path) -> dict[tuple[str, str, int], tuple[str, tuple[str, ...]]]:
    """(partition, method, seed) -> (config hash, the metrics missing at that seed) of every seed the
    suite's result file records with its per-seed values (empty without a result file of this suite).
    A seed that lacks only a metric added since it ran counts as recorded, as its run folder would
    ('done'): the plan is the same on a machine without outputs/, and no hour-long cell runs again
    for one metric (its stat keeps its own `seeds:`)."""
    path = app_dir / "results" / f"{suite.name}.yaml"
    if not path.is_file():
        return {}
    results = load_results(path)
    if results.suite != suite.name:
        return {}
    return {
        (c.partition, c.method, seed): (c.config_sha256, _missing_at(c.stats, seed))
        for c in results.cells
        if c.config_sha256 and all(s.per_seed is not None for s in c.stats.values())
        for seed in c.seeds
    }


def _missing_at(stats: dict[str, Stat], seed: int) -> tuple[str, ...]:
    """The metrics (a stat key's part before the dot) that a cell's result file lacks at `seed`."""
    return tuple(sorted({key.split(".")[0] for key, s in stats.items() if s.seeds is not None and seed not in s.seeds}))


def stale_cells(suite: Suite, app_dir: Path, app_defaults: dict[str, Any]) -> list[str]:
    """'partition/method' of every cell that the suite's result file records under another config
    hash than a run of the suite's cell would record today (a default or a method's revision changed
    since, or a key counted for the method changed): numbers of an earlier config that the report
    would show beside today's, and that a run of the suite would not skip but run again."""
    path = app_dir / "results" / f"{suite.name}.yaml"
    if not path.is_file():
        return []
    results = load_results(path)
    cells = {(c.partition, c.method): c for c in suite.cells}
    stale = []
    for recorded in results.cells:
        if not recorded.config_sha256 or (cell := cells.get((recorded.partition, recorded.method))) is None:
            continue
        cfg = validate({**app_defaults, **cell.overrides, **results.overrides, "num-partitions": cell.num_supernodes})
        if config_sha256(cfg) != recorded.config_sha256:
            stale.append(f"{recorded.partition}/{recorded.method}")
    return stale


def _plan(
    cell: Cell, run_dir: Path, cfg: dict, subm: dict, app_dir: Path, rerun_changed: bool, node_states: bool = False
) -> CellPlan:
    """One cell's action; `subm` are its overrides with overwrite=true."""
    if (run_dir / "summary.json").is_file():
        changes = saved_changes(run_dir, cfg) or revision_change(run_dir, cfg["method"])
        if not changes:
            return CellPlan(cell, "done", {})
        return CellPlan(cell, "rerun" if rerun_changed else "changed", subm if rerun_changed else {}, changes)
    fresh = {**subm, "overwrite": False}
    if not any((run_dir / name).exists() for name in RESULTS):
        return CellPlan(cell, "run", fresh)
    stopped_at = stopped_round(run_dir, cfg)
    if not stopped_at:
        return CellPlan(cell, "afresh", subm, "no usable checkpoint of this config")
    kept = ""
    if note := get_method(cfg["method"]).resume_note(cfg):
        if not node_states or cfg["engine"] == "batched":
            return CellPlan(cell, "afresh", subm, f"not resumed after round {stopped_at}: {note}")
        try:
            load_node_states(run_dir, stopped_at, cfg)
        except ValueError as e:
            return CellPlan(cell, "afresh", subm, f"not resumed after round {stopped_at}: {note}, and {e}")
        kept = ", its nodes' states kept"
    try:  # the resume's own checks: checkpoint, config.json and the per-round files
        _, resumed = prepare_config(app_dir, {**fresh, "resume": True}, cell.num_supernodes)
    except ConfigError as e:
        return CellPlan(cell, "afresh", subm, str(e))
    return CellPlan(cell, "resume", resumed, f"after round {stopped_at}{kept}")


def revision_change(run_dir: Path, method: str) -> str:
    """'' when the finished run in `run_dir` ran `method`'s current revision (`MethodSpec.revision`;
    a summary without one: revision 0), else what changed."""
    try:
        ran = int(json.loads((run_dir / "summary.json").read_text()).get("method-revision", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        ran = 0
    now = get_method(method).revision
    return "" if ran == now else f"changed: {method} revision {ran}, now {now}"


def describe(plans: list[CellPlan]) -> str:
    """The warning about finished cells computed under another config ('' when there is none)."""
    changed = [p for p in plans if p.action == "changed"]
    if not changed:
        return ""
    cells = "; ".join(f"{p.cell.run_name} ({p.note})" for p in changed)
    return (
        f"warning: {len(changed)} finished cell(s) were computed under another config and are kept as they "
        f"are: {cells}; --rerun-changed runs them again (their earlier files are set aside, not deleted)"
    )


def run_suite(
    suite: Suite,
    app_dir: Path,
    stream: bool = False,
    actors: int | None = None,
    cells: list[Cell] | None = None,
    rerun_changed: bool = False,
    cluster: RayCluster | None = None,
) -> None:
    """Run every cell not done yet (of `cells`, default all the suite's), one after the other on one
    private SuperLink and Ray head (started once) or on the nodes of `cluster`, each with every core
    busy (or `actors` clients at once), with progress and time left; then write the report of every
    finished cell. Every cell is checked first (`plan_cells`), so a cell a run would refuse stops the
    suite before anything starts."""
    chosen = suite.cells if cells is None else cells
    with locked(suite.run_folders(chosen)):  # planned and run by this process alone
        _run_cells(suite, app_dir, chosen, stream, actors, rerun_changed, cluster, of_all=cells is None)


def _run_cells(
    suite: Suite,
    app_dir: Path,
    chosen: list[Cell],
    stream: bool,
    actors: int | None,
    rerun_changed: bool,
    cluster: RayCluster | None,
    of_all: bool,
) -> None:
    """`run_suite` under the locks of the chosen cells' folders."""
    plans = plan_cells(suite, app_dir, chosen, actors, rerun_changed, cluster)
    suite.folder.mkdir(parents=True, exist_ok=True)
    todo = [p for p in plans if p.runs]
    done_before = len(chosen) - len(todo)
    of = "" if of_all else f" of the suite's {len(suite.cells)}"
    print(f"suite {suite.name}: {len(chosen)} cells{of}, {done_before} already done -> {suite.folder}", flush=True)
    if warning := describe(plans):
        print(warning, flush=True)
    spent: list[float] = []
    failed = []
    defaults = app_defaults(app_dir)
    batched = {p.cell.run_name for p in todo if validate({**defaults, **p.overrides})["engine"] == "batched"}
    flower = [p for p in todo if p.cell.run_name not in batched]  # a SuperLink only for these
    planned = {resources_for(validate({**defaults, **p.cell.overrides}), actors, cluster) for p in flower}
    if cluster:
        for resources in sorted(planned, key=lambda r: r.threads):
            print(f"suite {suite.name}: on the Ray cluster at {cluster.address}: {resources.describe()}", flush=True)
            if note := cluster.check_room(resources):
                print(note, flush=True)
    # one Ray head for the whole suite when every cell needs the same actors (the usual case)
    head = planned.pop() if len(planned) == 1 and not cluster else None
    with simulation_link(app_dir, head, cluster) if flower else nullcontext() as link:
        for i, plan in enumerate(todo, start=1):
            cell = plan.cell
            t0 = time.perf_counter()
            label = f"[{done_before + i}/{len(chosen)}] {cell.partition} / {cell.method} / seed {cell.seed}"
            print(f"{label} ...", flush=True)
            if plan.action == "resume":
                print(f"{label}: resuming {plan.note}", flush=True)
            elif plan.action in ("afresh", "rerun"):
                print(
                    f"{label}: running afresh ({plan.note}); its earlier files go to its aside-<time> folder",
                    flush=True,
                )
            try:
                cfg = validate({**defaults, **plan.overrides})
                if cell.run_name in batched:
                    from fedskew.batched.grid import run_batched  # torch: not for a suite's dry run

                    s = run_batched({**defaults, **plan.overrides}, cell.num_supernodes, quiet=not stream)
                else:
                    resources = resources_for(cfg, actors, cluster)
                    s = run_simulation(
                        app_dir, plan.overrides, cell.num_supernodes, stream=stream, resources=resources, link=link
                    )
                result = "last 10 rounds: " + ", ".join(
                    f"{name} {s[key]:.4f}" if s.get(key) is not None else f"{name} n/a"
                    for name, key in (
                        ("global", "last10_global_accuracy"),
                        ("client-global", "last10_client_global_accuracy"),
                        ("personalized", "last10_personalized_accuracy"),
                    )
                )
            except RunFailed as e:
                failed.append(cell)
                result = f"FAILED: {e}"
            spent.append(time.perf_counter() - t0)
            left = np.mean(spent) * (len(todo) - i)
            print(f"{label}: {result} in {spent[-1]:.0f} s; about {_fmt_eta(left)} left", flush=True)
    print(comparison(suite, write_report(suite)), flush=True)
    if failed:
        raise RunFailed(f"{len(failed)} cell(s) failed: " + ", ".join(c.run_name for c in failed))


def stopped_round(run_dir: Path, cfg: dict[str, Any]) -> int:
    """The round of `run_dir`'s checkpoint when that run stopped part-way with the config `cfg` (an
    interrupted suite cell), else 0: a changed config, or no readable checkpoint, starts afresh."""
    import torch

    if saved_changes(run_dir, cfg):
        return 0
    try:  # mmap: only the round number is read here (the resume's checks read the whole checkpoint)
        return int(torch.load(run_dir / "checkpoint.pt", weights_only=True, mmap=True)["round"])
    except Exception:  # a damaged file: pickle, zip, EOF or torch errors alike
        return 0


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics rows, rounds 1..R in order (`read_rounds`: else ConfigError naming the file)."""
    return read_rounds(run_dir / "metrics.jsonl")


def columns(last: int) -> list[tuple[str, str]]:
    """(column label, `round_statistics` key) of the table's accuracy columns, last-k means first."""
    return [
        (f"global, last {last}", f"last{last}_global_accuracy"),
        (f"global oscillation, last {last}", f"last{last}_global_accuracy_round_std"),
        ("global, final", "final_global_accuracy"),
        ("global, best", "best_global_accuracy"),
        (f"balanced, last {last}", f"last{last}_global_balanced_accuracy"),
        (f"worst class, last {last}", f"last{last}_global_worst_class_accuracy"),
        (f"client-global, last {last}", f"last{last}_client_global_accuracy"),
        (f"personalized, last {last}", f"last{last}_personalized_accuracy"),
        ("personalized, final", "final_personalized_accuracy"),
        (f"generic (personalized on the test set), last {last}", f"last{last}_personalized_central_accuracy"),
        (f"personalized on held classes, last {last}", f"last{last}_personalized_held_accuracy"),
        (f"personalized on missing classes, last {last}", f"last{last}_personalized_missing_accuracy"),
    ]


def collect(suite: Suite) -> list[dict[str, Any]]:
    """One row per (partition, method): mean and std over the finished seeds of every numeric
    `round_statistics` value (computed from each run's `metrics.jsonl`) and the wall time
    (`run_seconds`: a resumed run's counts its earlier processes' rounds; the per-class lists and the
    worst class's id are not averaged: `per_class_table` has them)."""
    table = []
    for p in suite.partition_labels:
        for m in suite.method_labels:
            runs = []
            for c in suite.cells:
                run_dir = suite.folder / c.run_name
                if c.partition == p and c.method == m and (run_dir / "summary.json").is_file():
                    summary = json.loads((run_dir / "summary.json").read_text())
                    stats = round_statistics(_read_rows(run_dir), suite.last_rounds)
                    numbers = {
                        k: v for k, v in stats.items() if not k.endswith(("_per_class_accuracy", "_worst_class"))
                    }
                    runs.append({**numbers, "wall_seconds": run_seconds(run_dir, summary["wall_seconds"])})
            if not runs:
                continue
            row: dict[str, Any] = {"partition": p, "method": m, "seeds": len(runs)}
            for key in runs[0]:
                vals = np.array([r[key] for r in runs if r[key] is not None], dtype=float)
                row[f"{key}_mean"] = float(vals.mean()) if len(vals) else float("nan")
                row[f"{key}_std"] = float(vals.std()) if len(vals) else float("nan")
            table.append(row)
    return table


REPORT_FILES = ("results.md", "results.csv")
REPORT_WAIT = 60.0  # s a suite's report waits for another process's report of it (seconds, not a run)


def write_report(suite: Suite) -> list[dict[str, Any]]:
    """results.md, results.csv and accuracy-<partition>.png in the suite folder, under their locks
    (waiting up to `REPORT_WAIT` for another report of the suite: each file from one reading)."""
    with locked([suite.folder / name for name in REPORT_FILES], wait=REPORT_WAIT):
        return _write_report(suite)


def _write_report(suite: Suite) -> list[dict[str, Any]]:
    table = collect(suite)
    if not table:
        return table
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(table[0]))
    writer.writeheader()
    writer.writerows(table)
    write_text(suite.folder / "results.csv", buf.getvalue())

    def pm(row: dict, key: str) -> str:
        return f"{100 * row[key + '_mean']:.2f} ± {100 * row[key + '_std']:.2f}"

    cols = [
        (label, key) for label, key in columns(suite.last_rounds) if any(np.isfinite(r[key + "_mean"]) for r in table)
    ]
    lines = [
        f"# {md(suite.name)}: accuracy (%), mean ± std over seeds",
        "",
        f"Last {suite.last_rounds} = the mean of the last {suite.last_rounds} rounds of each run (conclusions "
        "are drawn from it: label-skewed FL swings several points from round to round); oscillation = the std "
        "of the global accuracy over those rounds. Global: the server's model on the "
        "official test set; balanced: its mean per-class accuracy; worst class: the accuracy of its worst class "
        "in each round (which class may change). Client-global: the global model each sampled client receives, "
        "on its local test split, averaged over clients. Personalized: each method's personalized model on the "
        "client's local test split; for fedavg / fedprox that is the locally trained model (FedAvg-FT). "
        "Generic: each client's personalized model on the official test set, averaged over clients (the "
        "generic accuracy, GA, of personalized methods in FedGELA's and FedRoD's papers; the global accuracy of "
        "a method without a global model); on held / missing classes: restricted to the classes the client "
        "holds / lacks (`personalized-central-eval`).",
        "",
        "| partition | method | seeds | " + " | ".join(label for label, _ in cols) + " | wall s |",
        "|---|---|---|" + "---|" * (len(cols) + 1),
    ]
    for r in table:
        cells = " | ".join(pm(r, key) for _, key in cols)
        row = f"| {md(r['partition'])} | {md(r['method'])} | {r['seeds']} | {cells} | {r['wall_seconds_mean']:.0f} |"
        lines.append(row)
    lines += per_class_section(suite, [p for p in suite.partition_labels if any(r["partition"] == p for r in table)])
    write_text(suite.folder / "results.md", "\n".join(lines) + "\n")
    for p in suite.partition_labels:
        if any(r["partition"] == p for r in table):  # no finished cell: no (empty) plot
            plot_partition(suite, p)
            plot_per_class(suite, p)
    return table


def _finished(suite: Suite, partition: str, method: str | None = None) -> list[Cell]:
    return [
        c
        for c in suite.cells
        if c.partition == partition
        and (method is None or c.method == method)
        and (suite.folder / c.run_name / "summary.json").is_file()
    ]


def per_class(suite: Suite, partition: str, method: str) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Mean and std over the finished seeds of each class's last-k-round mean accuracy of the global
    model (NaN for a class no run measured), and the number of runs; None without per-class records."""
    runs = [
        last_rounds_per_class(_read_rows(suite.folder / c.run_name), "global-per-class-accuracy", suite.last_rounds)
        for c in _finished(suite, partition, method)
    ]
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    vals = np.array([[np.nan if v is None else v for v in r] for r in runs], dtype=float)
    with warnings.catch_warnings():  # a class absent from every run stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(vals, axis=0), np.nanstd(vals, axis=0), len(runs)


def per_class_section(suite: Suite, partitions: list[str]) -> list[str]:
    """results.md's per-class part: for each partition the classes one client holds for the most
    part (per seed, from the runs' `partition.json`) and, up to 20 classes, a table of each method's
    per-class accuracy (last-k mean, mean over seeds) with its worst class."""
    lines: list[str] = []
    for p in partitions:
        rows = [(m, per_class(suite, p, m)) for m in suite.method_labels]
        rows = [(m, pc) for m, pc in rows if pc is not None]
        if not rows:
            continue
        if not lines:
            lines = ["", f"## Per class: the global model's accuracy (%), mean of the last {suite.last_rounds} rounds"]
        lines += ["", f"### {md(p)}", ""]
        seen: set[int] = set()
        for c in _finished(suite, p):
            if c.seed in seen or not (suite.folder / c.run_name / "partition.json").is_file():
                continue
            seen.add(c.seed)
            skew = json.loads((suite.folder / c.run_name / "partition.json").read_text()).get("skew")
            if skew:
                owned = ", ".join(
                    f"{d['class']} ({100 * d['share']:.0f} % on client {d['client']})"
                    for d in skew["dominated-classes"]
                )
                lines.append(f"- seed {c.seed}: classes held > 90 % by one client: {owned or 'none'}")
        num_classes = len(rows[0][1][0])
        if num_classes > 20:
            lines += ["", f"(per-class-{md(p)}.png: {num_classes} classes are too many for a table)"]
            continue
        lines += [
            "",
            "| method | seeds | " + " | ".join(map(str, range(num_classes))) + " | worst |",
            "|---|---|" + "---|" * (num_classes + 1),
        ]
        for m, (mean, _, n) in rows:
            cells = " | ".join("absent" if np.isnan(v) else f"{100 * v:.1f}" for v in mean)
            worst = "-" if np.isnan(mean).all() else str(int(np.nanargmin(mean)))
            lines.append(f"| {md(m)} | {n} | {cells} | {worst} |")
    return lines


def plot_per_class(suite: Suite, partition: str) -> None:
    """`per-class-<partition>.png`: each method's per-class accuracy of the global model (last-k mean,
    mean over seeds, std as error bars), one group of bars per class."""
    from matplotlib.figure import Figure

    rows = [(m, per_class(suite, partition, m)) for m in suite.method_labels]
    rows = [(m, pc) for m, pc in rows if pc is not None]
    if not rows:
        return
    num_classes = len(rows[0][1][0])
    fig = Figure(figsize=(min(16.0, 2.5 + 0.35 * num_classes * len(rows)), 4.0), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(rows)
    for i, (m, (mean, std, n)) in enumerate(rows):
        x = np.arange(num_classes) + (i - (len(rows) - 1) / 2) * width
        ax.bar(x, mean, width, yerr=std if n > 1 else None, color=f"C{suite.method_labels.index(m)}", label=m)
    ax.set_xticks(range(0, num_classes, max(1, num_classes // 25)))
    ax.set_xlabel("class")
    ax.set_ylabel(f"accuracy, last {suite.last_rounds} rounds")
    ax.set_ylim(0, 1)
    ax.set_title(f"{suite.name}: {partition}, global model per class")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    save_png(fig, suite.folder / f"per-class-{partition}.png")


def plot_partition(suite: Suite, partition: str) -> None:
    """Global (solid), client-global (dotted) and personalized (dashed) accuracy per round, mean over
    seeds, one colour per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(suite.method_labels):
        runs = [
            _read_rows(suite.folder / c.run_name) for c in suite.cells if c.partition == partition and c.method == m
        ]
        runs = [r for r in runs if r]
        if not runs:
            continue
        n = min(len(r) for r in runs)
        rounds = [row["round"] for row in runs[0][:n]]
        for key, style in (("global-accuracy", "-"), ("client-global-accuracy", ":"), ("personalized-accuracy", "--")):
            vals = np.array([[row.get(key) if row.get(key) is not None else np.nan for row in r[:n]] for r in runs])
            if np.isnan(vals).all():  # not measured (e.g. no local test split): no line
                continue
            with warnings.catch_warnings():  # a round no seed measured stays a gap
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(vals, axis=0)
            ax.plot(
                rounds,
                mean,
                style,
                color=f"C{i}",
                label=f"{m} ({key.removesuffix('-accuracy')})",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{suite.name}: {partition}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_png(fig, suite.folder / f"accuracy-{partition}.png")
    plt.close(fig)


def save_png(fig: Any, path: Path) -> None:
    """A figure as a PNG, whole or not at all (`atomic_write`)."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))


COMPARED = (
    ("global", "global_accuracy"),
    ("balanced", "global_balanced_accuracy"),
    ("worst class", "global_worst_class_accuracy"),
    ("personalized", "personalized_accuracy"),
)


def comparison(suite: Suite, table: list[dict[str, Any]]) -> str:
    """The finished cells side by side, one line each: the mean of the last k rounds of the global,
    balanced, worst-class and personalized accuracy (%, mean over seeds; n/a: not measured), then
    where the table and the plots are."""
    last = suite.last_rounds
    lines = [
        f"suite {suite.name}: accuracy (%), mean of the last {last} rounds, mean over the finished seeds",
        f"{'partition':<14} {'method':<16} {'seeds':>5} " + " ".join(f"{label:>12}" for label, _ in COMPARED),
    ]
    for row in table:
        values = [row.get(f"last{last}_{key}_mean", math.nan) for _, key in COMPARED]
        shown = " ".join(f"{'n/a':>12}" if not math.isfinite(v) else f"{100 * v:12.2f}" for v in values)
        lines.append(f"{row['partition']:<14} {row['method']:<16} {row['seeds']:>5} {shown}")
    plots = ", ".join(str(suite.folder / f"accuracy-{p}.png") for p in dict.fromkeys(r["partition"] for r in table))
    lines += [
        f"table: {suite.folder / 'results.md'}",
        f"plots: {plots} (every method, per round); each run's accuracy.png in its folder "
        f"{suite.folder}/<partition>--<method>--s<seed>/",
    ]
    return "\n".join(lines)
