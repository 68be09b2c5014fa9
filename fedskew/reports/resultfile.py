"""Committed result files, `results/<name>.yaml`: the numbers behind every report table.

Run folders (`outputs/`) are not committed; a result file keeps what the reports need of them, one
entry per cell (a suite's partition label x method label)::

    suite: paper-fedrs                    # the suite the cells belong to
    suite-file: suites/paper-fedrs.yaml   # its protocol; `overrides` (optional): what every cell
    cells:                                #   ran with beyond it, e.g. {model: tfcnn}
    - partition: c10-100-2
      method: fedrs-0.5
      seeds: [0, 1, 2]
      rounds: 300
      config: {...}                       # the cell's run config as the suite gives it (no seed)
      config-sha256: 3f1c...              # of the validated config the runs saved (no seed, no paths)
      source: what produced the numbers   # an export from run folders, or a migration
      note: optional, one line (a re-export keeps it)
      wall-seconds: {0: 84.2, ...}        # optional: each seed's run, its wall time
      clipped-updates: {0: 0, 1: 3, ...}  # optional: each seed's run, the updates `update-norm-bound`
                                          #   clipped (seeds exported before it was kept: absent)
      stopped-at-round: {1: 46}           # optional: a seed whose run stopped at a round no retry
                                          #   completed (`stopped.json`); its stats are over the rounds
                                          #   before it (a diverged run counts, it is not left out)
      processor: {AMD EPYC 7B13 (AVX2): [0, 1], ...}  # optional: what ran each seed's arithmetic
                                          #   (`fedskew.training.processor`; absent: not recorded)
      stats:
        global.last50: {mean: 85.28, std: 0.43, per-seed: [85.6, 85.1, 85.2]}

A statistic is named `<metric>.<statistic>`. Metrics: `global` (the server's model on the official
test set), `client-global` (the global model each sampled client receives, on its local test
split), `personalized` (each method's personalized model there, the mean over clients; FedAvg's is
its locally trained model, FedAvg-FT), `personalized-pooled` (the same, pooled: the clients' correct
answers over their test samples), `balanced` and `worst-class` (the global model's mean per-class
accuracy and its worst class's), or another measured accuracy (MAP's `stage2`). Statistics:
`last<k>` the mean of the last k rounds (the one conclusions are drawn from: label-skewed FL swings
from round to round), `osc<k>` the std of the global accuracy over those rounds (the oscillation
FedRS reports), `r<a>-<b>` / `osc<a>-<b>` the same over rounds a..b, `final` and `best`. Values are
percent; `std` is the population std over the seeds (as the suite tables), absent where not known;
`per-seed` follows `seeds`, absent where the values were not kept. A stat measured on fewer seeds
than its cell names them itself (`seeds`).

`fedskew experiment SUITE --export` writes a suite's finished cells (`export_suite`), replacing
those cells in the file and keeping the others, so a method added later is added by running and
exporting only its cells. Every file is checked when read (`load_results`): a wrong key, type or
value is a ConfigError naming the file and the key; every value is a percentage in [0, 100] (a
mean of 1e308 would give a 300-digit table cell and an infinite gain). An export holds the result
file's lock (`fedskew.files.locked`: a second export into it is refused), writes it atomically (a
full disk leaves the old file whole), and refuses a run whose `metrics.jsonl` rounds are not
1..R in order (two writers in one run folder), naming the file and the first bad round.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedskew.config import OUTPUT_KEYS, PLACE_KEYS, START_KEYS, ConfigError, all_params, validate
from fedskew.files import locked, write_text
from fedskew.registry import METHODS, config_keys, get_method
from fedskew.resources import MAX_PROCESSOR_NAME

# metric -> the `round_statistics` name of its accuracy (`<stat>_<name>`)
METRICS = {
    "global": "global_accuracy",
    "client-global": "client_global_accuracy",
    "personalized": "personalized_accuracy",
    # the same models' accuracy pooled over the clients' test samples (PFLlib's statistic)
    "personalized-pooled": "personalized_pooled_accuracy",
    "balanced": "global_balanced_accuracy",
    "worst-class": "global_worst_class_accuracy",
    # the personal models' mean on the central test set (`personalized-central-eval`): the GA of a
    # method without one global model, as FedGELA's and FedRoD's papers define it
    "personalized-central": "personalized_central_accuracy",
    # MuPFL under `mupfl-init="cluster"`: a returning client's start, and that start after PKCF's
    # classifier fine-tune (the personalized model Alg. 1 evaluates)
    "mupfl-start": "start_accuracy",
    "mupfl-pkcf": "pkcf_accuracy",
}
# how a table's caption names a metric whose key does not say it
METRIC_WORDS = {
    "personalized-pooled": "the personalized models' accuracy pooled over the clients' test samples",
    "mupfl-start": "MuPFL's returning-client start",
    "mupfl-pkcf": "MuPFL's returning-client start after PKCF's fine-tune",
}
STAT_NAME = re.compile(r"^[a-z][a-z0-9-]*\.(last\d+|osc\d+|osc\d+-\d+|r\d+-\d+|final|best)$")
FILE_KEYS = {"suite", "suite-file", "overrides", "cells"}
CELL_KEYS = {
    *("partition", "method", "seeds", "rounds", "config", "config-sha256", "device", "wall-seconds", "source"),
    *("note", "stats", "clipped-updates", "stopped-at-round", "processor"),
}
MAX_WALL_SECONDS = 365 * 86400.0  # a run's wall time in a result file: a year at most
MAX_CLIPPED = 10**9  # a run's clipped updates in a result file
STAT_KEYS = {"mean", "std", "per-seed", "seeds"}
# where and how, not what (the trackers only copy the metrics)
UNHASHED = ("seed", *PLACE_KEYS, *START_KEYS, *OUTPUT_KEYS)
PERCENT = (0.0, 100.0)  # every statistic is an accuracy or its std, in percent
RESULT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a result file's stem: results/<name>.yaml


@dataclass
class Stat:
    mean: float
    std: float | None = None
    per_seed: list[float] | None = None
    seeds: list[int] | None = None  # only when fewer than the cell's


@dataclass
class CellResult:
    partition: str
    method: str
    seeds: list[int]
    stats: dict[str, Stat]
    rounds: int | None = None
    config: dict[str, Any] | None = None
    config_sha256: str = ""
    source: str = ""
    note: str = ""
    device: str = ""  # where its runs ran ("cpu", "cuda", "cpu, cuda"), '' where not recorded
    # each seed's run: its wall time in seconds (`summary.json`'s wall_seconds, plus the rounds a
    # resumed run kept from earlier processes: `run_seconds`), where recorded
    wall_seconds: dict[int, float] = field(default_factory=dict)
    # each seed's run: how many updates `update-norm-bound` clipped, where recorded (a seed exported
    # before this was kept is absent: unknown, not 0)
    clipped: dict[int, int] = field(default_factory=dict)
    # each seed's run: the processor that ran it (`summary.json`'s processor), where recorded
    processor: dict[int, str] = field(default_factory=dict)
    # each seed whose run stopped: the round no retry completed (`stopped.json`); its statistics are
    # over the rounds before it
    stopped: dict[int, int] = field(default_factory=dict)

    def stat_seeds(self, name: str) -> list[int]:
        return self.stats[name].seeds or self.seeds


@dataclass
class ResultSet:
    name: str  # the file's stem: cell references are <name>/<partition>/<method>
    suite: str
    suite_file: str
    cells: list[CellResult]
    overrides: dict[str, Any] = field(default_factory=dict)

    def cell(self, partition: str, method: str) -> CellResult | None:
        return next((c for c in self.cells if c.partition == partition and c.method == method), None)


def describe_stat(name: str) -> str:
    """'global.last10' -> 'global accuracy, mean of the last 10 rounds' (for tables and captions)."""
    metric, stat = name.split(".", 1)
    what = f"{METRIC_WORDS.get(metric, metric)} accuracy"
    if m := re.fullmatch(r"last(\d+)", stat):
        return f"{what}, mean of the last {m[1]} rounds"
    if m := re.fullmatch(r"osc(\d+)", stat):
        return f"{what}, std over the last {m[1]} rounds (oscillation)"
    if m := re.fullmatch(r"osc(\d+)-(\d+)", stat):
        return f"{what}, std over rounds {m[1]}-{m[2]} (oscillation)"
    if m := re.fullmatch(r"r(\d+)-(\d+)", stat):
        return f"{what}, mean of rounds {m[1]}-{m[2]}"
    return f"{what}, {stat} round"


# ---------------------------------------------------------------------------------------------- reading


def refused(path: Path, where: str, value: Any, rule: str) -> ConfigError:
    """The error for a hostile or malformed value of a result file: which file, which key, which value, the rule."""
    return ConfigError(f"{path}: {where}={value!r} is not allowed: {rule}")


def percent_value(path: Path, where: str, value: Any) -> float:
    """A statistic's value: a number in `PERCENT`."""
    low, high = PERCENT
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        raise refused(path, where, value, f"must be a number in [{low:g}, {high:g}] (a percentage)")
    return float(value)


def _seeds(path: Path, where: str, value: Any) -> list[int]:
    ok = isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    if not ok or len(set(value)) != len(value):
        raise refused(path, where, value, "must be a non-empty list of distinct integers")
    return list(value)


def _text(path: Path, where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise refused(path, where, value, "must be text")
    return value


def _mapping(path: Path, where: str, value: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise refused(path, where, value, "must be a mapping with text keys")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{path}: {where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    return value


def _stat(path: Path, where: str, raw: Any, cell_seeds: list[int]) -> Stat:
    raw = _mapping(path, where, raw, STAT_KEYS)
    if "mean" not in raw:
        raise ConfigError(f"{path}: {where}: no mean")
    seeds = _seeds(path, f"{where}.seeds", raw["seeds"]) if "seeds" in raw else None
    if seeds is not None and not set(seeds) <= set(cell_seeds):
        raise refused(path, f"{where}.seeds", seeds, f"must be among the cell's seeds {cell_seeds}")
    std = percent_value(path, f"{where}.std", raw["std"]) if raw.get("std") is not None else None
    per_seed = raw.get("per-seed")
    if per_seed is not None:
        n = len(seeds or cell_seeds)
        if not isinstance(per_seed, list) or len(per_seed) != n:
            raise refused(path, f"{where}.per-seed", per_seed, f"must be a list of {n} numbers, one per seed")
        per_seed = [percent_value(path, f"{where}.per-seed[{i}]", v) for i, v in enumerate(per_seed)]
    return Stat(percent_value(path, f"{where}.mean", raw["mean"]), std, per_seed, seeds)


def _cell(path: Path, i: int, raw: Any) -> CellResult:
    where = f"cells[{i}]"
    raw = _mapping(path, where, raw, CELL_KEYS)
    for key in ("partition", "method", "seeds", "stats"):
        if key not in raw:
            raise ConfigError(f"{path}: {where}: no {key}")
    seeds = _seeds(path, f"{where}.seeds", raw["seeds"])
    stats_raw = raw["stats"]
    if not isinstance(stats_raw, dict):
        raise refused(path, f"{where}.stats", stats_raw, "must be a mapping of statistics")
    stats = {}
    for name, value in stats_raw.items():
        if not isinstance(name, str) or not STAT_NAME.match(name):
            raise refused(path, f"{where}.stats", name, "a statistic is <metric>.<last<k>|osc<k>|r<a>-<b>|final|best>")
        stats[name] = _stat(path, f"{where}.stats.{name}", value, seeds)
    rounds = raw.get("rounds")
    if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1):
        raise refused(path, f"{where}.rounds", rounds, "must be a positive integer")
    config = raw.get("config")
    if config is not None and not isinstance(config, dict):
        raise refused(path, f"{where}.config", config, "must be a mapping (the cell's run config)")
    return CellResult(
        partition=_text(path, f"{where}.partition", raw["partition"]),
        method=_text(path, f"{where}.method", raw["method"]),
        seeds=seeds,
        stats=stats,
        rounds=rounds,
        config=config,
        config_sha256=_text(path, f"{where}.config-sha256", raw.get("config-sha256", "")),
        source=_text(path, f"{where}.source", raw.get("source", "")),
        note=_text(path, f"{where}.note", raw.get("note", "")),
        device=_text(path, f"{where}.device", raw.get("device", "")),
        wall_seconds=_per_seed(
            path, f"{where}.wall-seconds", raw.get("wall-seconds", {}), seeds, _seconds, "seconds", MAX_WALL_SECONDS
        ),
        clipped=_per_seed(
            path,
            f"{where}.clipped-updates",
            raw.get("clipped-updates", {}),
            seeds,
            _count,
            "a count of updates",
            MAX_CLIPPED,
        ),
        processor=_processors(path, f"{where}.processor", raw.get("processor", {}), seeds),
        stopped=_per_seed(
            path,
            f"{where}.stopped-at-round",
            raw.get("stopped-at-round", {}),
            seeds,
            lambda v: v if _count(v) and (rounds is None or v <= rounds) else None,
            "a round, at least 1,",
            rounds or MAX_CLIPPED,
        ),
    )


def _seconds(value: Any) -> float | None:
    """A run's wall time: a number in [0, MAX_WALL_SECONDS]; None for anything else."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_WALL_SECONDS
    return float(value) if ok else None


def _count(value: Any) -> int | None:
    """A count of clipped updates: an integer in [0, MAX_CLIPPED]; None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_CLIPPED else None


def _per_seed(
    path: Path, where: str, raw: Any, seeds: list[int], accept: Callable[[Any], Any], what: str, most: float
) -> dict[int, Any]:
    """{seed: value} for some of the cell's seeds, each value as `accept` takes it (None: refused)."""
    if not isinstance(raw, dict):
        raise refused(path, where, raw, f"must be a mapping of seed to {what}")
    out = {}
    for seed, value in raw.items():
        if not isinstance(seed, int) or isinstance(seed, bool) or seed not in seeds:
            raise refused(path, where, seed, f"a key must be one of the cell's seeds {seeds}")
        if (taken := accept(value)) is None:
            raise refused(path, f"{where}[{seed}]", value, f"must be {what} in [0, {most:g}]")
        out[seed] = taken
    return out


def processor_text(value: Any) -> str | None:
    """A processor's name: printable text of 1 to MAX_PROCESSOR_NAME characters; None for anything else."""
    ok = (
        isinstance(value, str)
        and 0 < len(value) <= MAX_PROCESSOR_NAME
        and value.isprintable()
        and value.strip() == value
    )
    return value if ok else None


def _processors(path: Path, where: str, raw: Any, seeds: list[int]) -> dict[int, str]:
    """{seed: processor} from the file's {processor: [seeds]} (each seed one of the cell's, named once)."""
    if not isinstance(raw, dict):
        raise refused(path, where, raw, "must be a mapping of a processor's name to the seeds it ran")
    out: dict[int, str] = {}
    for name, ran in raw.items():
        if processor_text(name) is None:
            raise refused(path, where, name, f"a key must be printable text of 1 to {MAX_PROCESSOR_NAME} characters")
        ok = isinstance(ran, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in ran)
        if not ok or not set(ran) <= set(seeds) or len(set(ran)) != len(ran) or set(ran) & set(out):
            raise refused(path, f"{where}[{name!r}]", ran, f"must list some of the cell's seeds {seeds}, each once")
        out |= dict.fromkeys(ran, name)
    return out


def load_results(path: str | Path) -> ResultSet:
    """Read and check a result file (ConfigError naming the file and the key otherwise)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not readable ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    raw = _mapping(path, "the file", raw, FILE_KEYS)
    cells_raw = raw.get("cells") or []
    if not isinstance(cells_raw, list):
        raise refused(path, "cells", cells_raw, "must be a list of cells")
    cells = [_cell(path, i, c) for i, c in enumerate(cells_raw)]
    seen = set()
    for c in cells:
        if (c.partition, c.method) in seen:
            raise ConfigError(f"{path}: two cells for partition {c.partition!r}, method {c.method!r}")
        seen.add((c.partition, c.method))
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise refused(path, "overrides", overrides, "must be a mapping of run-config keys")
    return ResultSet(
        name=path.stem,
        suite=_text(path, "suite", raw.get("suite", path.stem)),
        suite_file=_text(path, "suite-file", raw.get("suite-file", "")),
        cells=cells,
        overrides=overrides,
    )


def load_all(folder: str | Path) -> dict[str, ResultSet]:
    """Every result file in `folder` by name (`claims.yaml` is not one)."""
    return {p.stem: load_results(p) for p in sorted(Path(folder).glob("*.yaml")) if p.name != "claims.yaml"}


# ---------------------------------------------------------------------------------------------- writing


class _Flow(dict):
    """A mapping written on one line (`{mean: 85.28, std: 0.43}`)."""


class _FlowList(list):
    """A list written on one line (`[0, 1, 2]`)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))
_Dumper.add_representer(_FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def _stat_raw(stat: Stat) -> dict[str, Any]:
    out: dict[str, Any] = {"mean": stat.mean}
    if stat.std is not None:
        out["std"] = stat.std
    if stat.per_seed is not None:
        out["per-seed"] = stat.per_seed
    if stat.seeds is not None:
        out["seeds"] = stat.seeds
    return _Flow(out)


def dump_results(results: ResultSet, path: str | Path) -> None:
    """Write `results` as YAML (one line per statistic), the form `load_results` reads."""
    cells = []
    for c in results.cells:
        raw: dict[str, Any] = {"partition": c.partition, "method": c.method, "seeds": _FlowList(c.seeds)}
        if c.rounds is not None:
            raw["rounds"] = c.rounds
        if c.config is not None:
            raw["config"] = _Flow(c.config)
        pairs = (("config-sha256", c.config_sha256), ("device", c.device), ("source", c.source), ("note", c.note))
        for key, value in pairs:
            if value:
                raw[key] = value
        if c.wall_seconds:
            raw["wall-seconds"] = _Flow({s: round(v, 1) for s, v in sorted(c.wall_seconds.items())})
        if c.clipped:
            raw["clipped-updates"] = _Flow(dict(sorted(c.clipped.items())))
        if c.stopped:
            raw["stopped-at-round"] = _Flow(dict(sorted(c.stopped.items())))
        if c.processor:
            names = sorted(set(c.processor.values()))
            raw["processor"] = _Flow({n: _FlowList(sorted(s for s, v in c.processor.items() if v == n)) for n in names})
        raw["stats"] = {name: _stat_raw(s) for name, s in c.stats.items()}
        cells.append(raw)
    top: dict[str, Any] = {"suite": results.suite, "suite-file": results.suite_file}
    if results.overrides:
        top["overrides"] = _Flow(results.overrides)
    top["cells"] = cells
    text = yaml.dump(top, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
    write_text(Path(path), text)  # whole or not at all: a full disk leaves the old file


# ---------------------------------------------------------------------------------------------- export


def config_sha256(saved: dict[str, Any], revision: int | None = None) -> str:
    """The hash of what a run's saved config decides about its numbers: without where it ran and
    its seed (`UNHASHED`), without the keys of other methods than its own (`fedskew.registry.config_keys`:
    a default of MuPFL's changes no FedAvg run) and without a `neutral` key at its default (one added
    later that changes nothing at that value), with the method's `revision` (its arithmetic fixed
    under the same config: the run's, from its summary, else the code's). Equal for every seed of a
    cell, and for the same cell run again with the same defaults of its keys and the same revision:
    seeds recorded under one hash are one population."""
    params = all_params()
    method = METHODS.get(str(saved.get("method")))
    others = set().union(*(m.params for m in METHODS.values())) - (config_keys(method) if method else set())
    what = {
        k: v
        for k, v in saved.items()
        if k not in UNHASHED and k not in others and not (k in params and params[k].neutral and v == params[k].default)
    }
    if revision is None:
        revision = method.revision if method is not None else 0
    if revision:
        what["method-revision"] = revision
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _summarise(values: list[float | None], seeds: list[int]) -> Stat | None:
    """The stat over the seeds with a value (percent, 4 decimals); None when no seed has one."""
    kept = [(s, 100 * v) for s, v in zip(seeds, values, strict=True) if v is not None]
    if not kept:
        return None
    partial = [s for s, _ in kept] if len(kept) < len(seeds) else None
    return seed_stat([v for _, v in kept], partial)


def seed_stat(percents: list[float], seeds: list[int] | None = None) -> Stat:
    """Mean and population std over per-seed values in percent (4 decimals, as result files keep them);
    `seeds`: the seeds they are of, where fewer than the cell's."""
    arr = np.array(percents, dtype=np.float64)
    return Stat(round(float(arr.mean()), 4), round(float(arr.std()), 4), [round(v, 4) for v in percents], seeds)


def recorded_time(cells: list[CellResult]) -> tuple[list[str], list[float], int]:
    """Where and how long the cells' runs ran, as recorded: their devices (sorted; none where not
    recorded), each timed run's wall seconds, and how many runs the cells hold."""
    devices = sorted({d for c in cells for d in c.device.split(", ") if d})
    return devices, [w for c in cells for w in c.wall_seconds.values()], sum(len(c.seeds) for c in cells)


def failed_round(run_dir: Path) -> int | None:
    """The round that no retry completed, at which the run in `run_dir` stopped (`stopped.json`); None
    when it did not stop so: it finished (`summary.json`), is still going or was killed, or the file
    holds no positive round (a file on disk is checked, not trusted). Not the round a stopped run
    resumes from (`fedskew.run.experiments.stopped_round`: its checkpoint's)."""
    if (run_dir / "summary.json").is_file():
        return None
    r = (_json_object(run_dir / "stopped.json") or {}).get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= MAX_CLIPPED else None


def stopped_text(cell: CellResult) -> str:
    """'seed 1 stopped at round 46' for each seed whose run stopped ('' for none)."""
    return ", ".join(f"seed {s} stopped at round {r}" for s, r in sorted(cell.stopped.items()))


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable, not JSON or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _summary(run_dir: Path) -> dict[str, Any]:
    """A run's `summary.json`, else its `stopped.json` (where it ran, for a run that stopped); {} when
    neither is an object (a run killed part-way)."""
    return _json_object(run_dir / "summary.json") or _json_object(run_dir / "stopped.json") or {}


def suite_config(suite: dict[str, Any], partition: str, method: str) -> dict[str, Any]:
    """A cell's run config as the suite's YAML gives it, without the seed: what a result file records
    as the cell's `config` (`fedskew.run.experiments.load_suite` builds it so)."""
    own = ((suite.get("partitions") or {}).get(partition) or {}).items()
    p_over = {k: v for k, v in own if k not in ("seeds", "num-supernodes")}
    return {**(suite.get("base") or {}), **p_over, "method": method, **((suite.get("methods") or {}).get(method) or {})}


def suite_seeds(suite: dict[str, Any], partition: str) -> Any:
    """A partition's seeds as the suite's YAML gives them: its own `seeds:`, else the suite's, else
    [0] (unchecked: `fedskew.run.experiments.load_suite` checks them)."""
    own = (suite.get("partitions") or {}).get(partition) or {}
    return own.get("seeds", suite.get("seeds", [0]))


def per_seed_values(cell: CellResult, name: str) -> dict[int, float] | None:
    """Seed -> value of the stat `name` of `cell`; None when its per-seed values were not kept."""
    stat = cell.stats[name]
    if stat.per_seed is None:
        return None
    return dict(zip(cell.stat_seeds(name), stat.per_seed, strict=True))


def merge_seeds(old: CellResult, fresh: CellResult) -> CellResult | None:
    """`fresh` with the seeds `old` recorded that `fresh` did not run, when both ran one config
    (`config_sha256`, the same rounds) and `old` kept every stat's per-seed values; None otherwise.
    A seed in both takes `fresh`'s values. A long suite's seeds thus accumulate across machines and
    sessions: the run folders of earlier seeds are gone, their values are in the file."""
    if not old.config_sha256 or old.config_sha256 != fresh.config_sha256 or old.rounds != fresh.rounds:
        return None
    kept = [s for s in old.seeds if s not in fresh.seeds]
    if not kept:
        return fresh
    values: dict[str, dict[int, float]] = {}
    for name in [*fresh.stats, *(n for n in old.stats if n not in fresh.stats)]:  # a stable order
        mine = per_seed_values(old, name) if name in old.stats else {}
        if mine is None:
            return None
        values[name] = {s: v for s, v in mine.items() if s in kept} | (
            per_seed_values(fresh, name) or {} if name in fresh.stats else {}
        )
    seeds = sorted({*fresh.seeds, *kept})
    stats = {}
    for name, by_seed in values.items():
        have = [s for s in seeds if s in by_seed]
        arr = np.array([by_seed[s] for s in have])
        stats[name] = Stat(
            round(float(arr.mean()), 4),
            round(float(arr.std()), 4),
            [by_seed[s] for s in have],
            have if len(have) < len(seeds) else None,
        )
    devices = ", ".join(sorted({d.strip() for c in (old, fresh) for d in c.device.split(",") if d.strip()}))
    source = f"{fresh.source}; seeds {kept} as recorded before"
    walls = {s: v for s, v in old.wall_seconds.items() if s in kept} | fresh.wall_seconds
    clipped = {s: v for s, v in old.clipped.items() if s in kept} | fresh.clipped
    ran = {s: v for s, v in old.processor.items() if s in kept} | fresh.processor
    stopped = {s: v for s, v in old.stopped.items() if s in kept} | fresh.stopped
    kept_fields = {"wall_seconds": walls, "clipped": clipped, "processor": ran, "stopped": stopped}
    return replace(fresh, seeds=seeds, stats=stats, source=source, device=devices, **kept_fields)


def cell_stats(runs: list[dict[str, Any]], seeds: list[int], last: int) -> dict[str, Stat]:
    """A cell's statistics from its seeds' `round_statistics` (fractions -> percent): for each metric
    its last-k mean, final and best round, and the global accuracy's oscillation over the last k."""
    names = {}
    for metric, key in METRICS.items():
        names[f"{metric}.last{last}"] = f"last{last}_{key}"
        names[f"{metric}.final"] = f"final_{key}"
        names[f"{metric}.best"] = f"best_{key}"
    names[f"global.osc{last}"] = f"last{last}_global_accuracy_round_std"
    stats = {}
    for name, key in names.items():
        stat = _summarise([run.get(key) for run in runs], seeds)
        if stat is not None:
            stats[name] = stat
    return stats


def export_suite(
    suite: Any,
    suite_file: str,
    app_defaults: dict[str, Any],
    folder: str | Path,
    *,
    runs: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    name: str = "",
    source: str = "",
    upto: int = 0,
    cells: list[Any] | None = None,
) -> Path:
    """Write the finished cells of `suite` (a `fedskew.run.experiments.Suite`) into `<folder>/<name>.yaml`
    (`name` defaults to the suite's) from their runs' `metrics.jsonl`, replacing those cells there and
    keeping the file's others. The runs are in `runs` (default: the suite's folder), computed with the
    suite's config plus `overrides` (recorded in the file, e.g. `device: cuda`). A run computed under
    another config than that (`changes_from`) is left out, with a warning; a cell with no finished
    run is not written, nor a run resumed part-way of a method whose clients keep state without the
    nodes' states put back (their state restarted: `MethodSpec.resume_note`). `source` says which
    command made the runs (default `fedskew experiment`). `upto` R > 0: every run's first R rounds,
    finished or stopped part-way (a run that has not reached round R is left out, with a warning),
    the cell's `rounds` R and its source saying so: runs of a lent machine cut at its deadline,
    compared at the rounds all reached.
    `cells`: only these of the suite's cells (`fedskew experiment --export --methods/--partitions/
    --seeds`); the file's other cells are kept. `name` must be a file stem (`check_result_name`)."""
    name = check_result_name(name or suite.name)
    path = Path(folder) / f"{name}.yaml"
    with locked([path]):  # read, merged and written by one export at a time
        return _export(suite, suite_file, app_defaults, path, runs, overrides, source, upto, cells)


def check_result_name(name: str) -> str:
    """`name` when it is a result file's stem (`RESULT_NAME`, not `claims`), else ConfigError: the
    file is `results/<name>.yaml`, so a name never leaves `results/` nor replaces the claims file."""
    if not RESULT_NAME.match(name) or name == "claims":
        raise ConfigError(
            f"export name {name!r} is not allowed: must be letters, digits, '.', '-' and '_' (not 'claims'), "
            "the stem of results/<name>.yaml"
        )
    return name


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's `metrics.jsonl` (`read_jsonl`), which must hold rounds 1..R in order;
    else ConfigError naming the file and the first bad round (two writers that shared the folder
    leave 1, 1, 2, 2 or 1, 2, 3, 1: statistics over them would be wrong)."""
    from fedskew.server_app.results import read_jsonl  # late: the run folder's module imports torch

    rows = read_jsonl(path)
    for expected, row in enumerate(rows, start=1):
        if row["round"] != expected:
            raise ConfigError(
                f"{path}: row {expected} holds round {row['round']}, not {expected}: its rounds must be 1..R in "
                "order (did two runs write into its folder?); run the cell again"
            )
    return rows


def _export(
    suite: Any,
    suite_file: str,
    app_defaults: dict[str, Any],
    path: Path,
    runs: str | Path | None,
    overrides: dict[str, Any] | None,
    source: str,
    upto: int,
    cells: list[Any] | None,
) -> Path:
    """`export_suite` under the result file's lock."""
    # late: the run folder's module imports torch, which `fedskew report` never needs
    from fedskew.server_app.results import changes_from, read_saved, resumed_rounds, round_statistics, run_seconds

    overrides = dict(overrides or {})
    name = path.stem
    run_folder = Path(runs) if runs is not None else suite.folder
    source = source or f"`fedskew experiment {suite_file} --export`"
    old = load_results(path) if path.is_file() else ResultSet(name, suite.name, suite_file, [], overrides)
    fresh: list[CellResult] = []
    for p in suite.partition_labels:
        for m in suite.method_labels:
            per_run, seeds, hashes, rounds, config, devices = [], [], set(), 0, None, set()
            walls: dict[int, float] = {}
            clipped: dict[int, int] = {}
            ran: dict[int, str] = {}
            stopped: dict[int, int] = {}
            for c in (c for c in (suite.cells if cells is None else cells) if c.partition == p and c.method == m):
                run_dir = run_folder / c.run_name
                stop = None if upto else failed_round(run_dir)
                if not (run_dir / ("metrics.jsonl" if upto else "summary.json")).is_file() and stop is None:
                    continue
                # as the run saved it: `fedskew run` sets num-partitions to the simulated clients
                cfg = validate({**app_defaults, **c.overrides, **overrides, "num-partitions": c.num_supernodes})
                saved = read_saved(run_dir)
                if saved is not None and saved.get("num-partitions") == 0:
                    cfg["num-partitions"] = 0  # in-process (`tests.harness`): the nodes' count, the same split
                if changes := changes_from(saved, cfg):
                    warnings.warn(f"{run_dir}: not exported, computed under another config ({changes})", stacklevel=2)
                    continue
                if (note := get_method(cfg["method"]).resume_note(cfg)) and (
                    resumed := resumed_rounds(run_dir, without_node_states=True)
                ):
                    warnings.warn(f"{run_dir}: not exported, resumed after round {resumed[0]}: {note}", stacklevel=2)
                    continue
                rows = read_rounds(run_dir / "metrics.jsonl")
                if upto:
                    rows = [r for r in rows if int(r["round"]) <= upto]
                    if len(rows) < upto:
                        warnings.warn(f"{run_dir}: not exported, {len(rows)} of the first {upto} rounds", stacklevel=2)
                        continue
                if stop is not None:
                    if len(rows) != stop - 1:  # the file does not describe these rows: not trusted
                        bad = f"not exported, stopped.json says round {stop} but metrics.jsonl holds {len(rows)}"
                        warnings.warn(f"{run_dir}: {bad}", stacklevel=2)
                        continue
                    if not rows:  # stopped in round 1: no round to count
                        warnings.warn(f"{run_dir}: not exported, stopped at round 1: no round to count", stacklevel=2)
                        continue
                    stopped[c.seed] = stop
                    warnings.warn(f"{run_dir}: stopped at round {stop}: exported over the rounds before", stacklevel=2)
                summary = _summary(run_dir)
                per_run.append(round_statistics(rows, suite.last_rounds))
                seeds.append(c.seed)
                # a run that predates revisions (no `method-revision` in its summary) is revision 0
                hashes.add(config_sha256(saved, int(summary.get("method-revision", 0))))
                devices.add(str(summary.get("device", "")))
                last = _seconds(summary.get("wall_seconds"))
                wall = None if last is None else _seconds(run_seconds(run_dir, last))  # a resumed run's: all its rounds
                if wall is not None:
                    walls[c.seed] = wall
                if (name := processor_text(summary.get("processor"))) is not None:
                    ran[c.seed] = name
                if any("update-clipped" in r for r in rows):  # a run from before the bound logs none: unknown
                    # each round's count as data (anything else counts 0: the run's own log, still a file)
                    clipped[c.seed] = min(MAX_CLIPPED, sum(_count(r.get("update-clipped")) or 0 for r in rows))
                rounds = max([rounds, cfg["num-server-rounds"] if stop else 0, *(int(r["round"]) for r in rows)])
                config = {k: v for k, v in {**c.overrides, **overrides}.items() if k != "seed"}
            if hit := [s for s, n in clipped.items() if n]:  # honest updates the bound changed
                warnings.warn(
                    f"{name}: {p}/{m}: seeds {hit} clipped updates at update-norm-bound: their numbers depend "
                    "on the bound (the cell records each seed's count as clipped-updates)",
                    stacklevel=2,
                )
            if per_run:
                fresh.append(
                    CellResult(
                        partition=p,
                        method=m,
                        seeds=seeds,
                        stats=cell_stats(per_run, seeds, suite.last_rounds),
                        rounds=rounds,
                        config=config,
                        config_sha256=hashes.pop() if len(hashes) == 1 else "",
                        device=", ".join(sorted(devices - {""})),
                        wall_seconds=walls,
                        clipped=clipped,
                        processor=ran,
                        stopped=stopped,
                        source=f"{source}, from the runs' metrics.jsonl"
                        + (f", their first {upto} rounds (runs stopped part-way included)" if upto else ""),
                    )
                )
    notes = {(c.partition, c.method): c.note for c in old.cells if c.note}
    fresh = [replace(c, note=notes.get((c.partition, c.method), "")) for c in fresh]
    for i, cell in enumerate(fresh):
        if (before := old.cell(cell.partition, cell.method)) is None or set(before.seeds) <= set(cell.seeds):
            continue
        if (merged := merge_seeds(before, cell)) is not None:
            fresh[i] = merged
        else:
            lost = sorted(set(before.seeds) - set(cell.seeds))
            warnings.warn(
                f"{name}: {cell.partition}/{cell.method}: seeds {lost} were recorded under another config "
                "(or without per-seed values): replaced by the runs' seeds",
                stacklevel=2,
            )
    replaced = {(c.partition, c.method) for c in fresh}
    kept = [c for c in old.cells if (c.partition, c.method) not in replaced]
    order = {(p, m): i for i, (p, m) in enumerate((p, m) for p in suite.partition_labels for m in suite.method_labels)}
    cells = sorted(fresh + kept, key=lambda c: order.get((c.partition, c.method), len(order)))
    path.parent.mkdir(parents=True, exist_ok=True)
    result = ResultSet(path.stem, suite.name, suite_file or old.suite_file, cells, overrides or old.overrides)
    dump_results(result, path)
    return path
