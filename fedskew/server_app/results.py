"""Everything a run leaves in `<out-dir>/<run-name>/`.

- `config.json`     the validated run config
- `partition.txt/.json/.png`  class counts per client and the partition's skew (`partition_skew`)
- `metrics.jsonl`   one line per round (deterministic: no timings), appended and flushed each round;
                    with `class-metrics` also the global model's per-class record (`fedskew.diagnostics`)
- `timings.jsonl`   seconds per round and per step, and each client's participation count (client state);
                    `resumed-after: R` on the first row a resumed run wrote (with
                    `node-states-restored: true` where its engine put the nodes' states of round R back)
- `failures.jsonl`  every lost or dropped reply: round, node, partition, reason
- `stopped.json`    a run that stopped at a round without enough usable replies (every retry): that
                    round and why (`RunOutput.write_stopped`); its rows hold the rounds before it
- `summary.json`    method (and its `revision`), the device, rounds, wall time and, for global,
                    client-global and personalized accuracy, the final value, the best and the mean
                    of the last 10 rounds (`round_statistics`)
- `model.pt`        the final global model's state dict (none for a method without one: FedProto)
- `checkpoint.pt`   every `checkpoint-every` rounds: round, global arrays, strategy state and the run's
                    `RESUME_FIXED` keys (`resume=true` continues from it; all server randomness is
                    derived from (seed, round))
- `accuracy.png`    global and personalized accuracy per round
- `per-class.png`   the global model's per-class accuracy, classes x rounds (`class-metrics`)
- `events.out.tfevents.*`  TensorBoard's copy of the metrics (`tensorboard`, `fedskew.server_app.tracking`)
- `aside-<time>-<random>/`  what a later start set aside instead of deleting it (`reason.txt` says why)

A run never deletes an earlier run's results. A folder that holds them is refused unless the run
resumes (`resume`) or starts afresh (`overwrite`: the earlier files move to `aside-<time>-*/`). A
resume first checks everything it reads (`check_run_folder`): the checkpoint's round, arrays and
strategy state, `config.json`'s method, model, data set and engine, and every line of the per-round files,
which must hold rounds 1..R of the checkpoint's round R; a damaged file is refused with the line it
fails at. Only rows after round R (rounds the resumed run computes again) and a torn last line (a
crash mid-write) are cut, and the original files are copied aside first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.config import COMMON, OUTPUT_KEYS, PLACE_KEYS, START_KEYS, ConfigError, all_params
from fedskew.data import dataset_slug
from fedskew.diagnostics import last_rounds_per_class, worst_class
from fedskew.files import atomic_write, check_folder
from fedskew.registry import METHODS, config_keys, get_method

log = logging.getLogger("flwr.fedskew")

RECORDS = ("metrics.jsonl", "timings.jsonl", "failures.jsonl")  # appended round by round
RESULTS = (*RECORDS, "summary.json", "stopped.json", "checkpoint.pt", "model.pt")  # what an earlier run would lose
RUN_FILES = ("config.json", "partition.txt", "partition.json", "partition.png", *RESULTS, "accuracy.png")
RUN_FILES += ("per-class.png",)
# what the checkpoint's arrays and state belong to, and the engine that computed them: the batched
# engine's stacked float32 kernels round differently from the per-client ones (equal in float64), so a
# run resumed on the other engine would equal neither engine's uninterrupted run
RESUME_FIXED = ("method", "model", "dataset", "engine")
EVENT_FILES = "events.out.tfevents.*"  # TensorBoard's (`fedskew.server_app.tracking`)
AFRESH = "or start afresh with `fedskew run --overwrite` (run config overwrite=true), which keeps its files aside"


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, obj: Any) -> None:
    """Write atomically and durably, so a crash never leaves half a file."""
    text = json.dumps(_clean(obj), indent=1, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(_clean(row), sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _row(line: str) -> dict[str, Any] | None:
    """A results line: a JSON object with a round number >= 1 (else None)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("round"), int) and not isinstance(row["round"], bool)
    return row if ok and row["round"] >= 1 else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a per-round jsonl file, for reports: every line that is a JSON object with a
    round number; any other line (a torn last line, a damaged or edited one) is skipped, not the
    rest of the file. A resume reads them strictly instead (`read_records`)."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [row for row in map(_row, lines) if row is not None]


RESUMED = re.compile(r"resume after round (\d+)")


def resumed_rounds(run_dir: Path, without_node_states: bool = False) -> list[int]:
    """The checkpoint rounds the run now in `run_dir` was resumed from, in order: the `resumed-after`
    of its `timings.jsonl` and, for a run from before that record, the reasons of the `aside-*/`
    folders written since the run's start (the last one set aside by `overwrite`, if any).
    `without_node_states`: only the resumes whose nodes started without their states (the row does
    not say `node-states-restored: true`)."""
    rows = [row for row in read_jsonl(run_dir / "timings.jsonl") if "resumed-after" in row]
    # a value that is not a round (an edited file) still says the run was resumed: 0
    every = {v if isinstance(v := row["resumed-after"], int) and not isinstance(v, bool) else 0 for row in rows}
    restored = {row["resumed-after"] for row in rows if row.get("node-states-restored") is True}
    marked = every - restored if without_node_states else every
    legacy: set[int] = set()
    for reason in sorted(run_dir.glob("aside-*/reason.txt"), key=lambda p: (p.stat().st_mtime, p.parent.name)):
        text = reason.read_text(errors="replace")
        if text.startswith("overwrite=true"):  # a start afresh: what was resumed before is not this run
            legacy.clear()
        elif match := RESUMED.match(text):
            legacy.add(int(match.group(1)))
    return sorted(marked | (legacy - every))  # the aside folders of the marked resumes say the same


def run_seconds(run_dir: Path, last: float) -> float:
    """A run's wall time: `last`, its last process's (`summary.json`'s `wall_seconds`), plus the
    `seconds` its `timings.jsonl` records for the rounds kept from earlier processes (those up to the
    round of its last resume; a value that is not a finite, non-negative number counts 0). Earlier
    processes' start-up and the rounds they ran past their checkpoint are not counted: this is the
    time of one run's rounds, not of every attempt. An unresumed run's is `last`."""
    rows = read_jsonl(run_dir / "timings.jsonl")
    marks = [v for row in rows if isinstance(v := row.get("resumed-after"), int) and not isinstance(v, bool)]
    if not marks:
        return last
    kept = (row.get("seconds") for row in rows if row["round"] <= marks[-1])
    ok = (s for s in kept if isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s < math.inf)
    return last + sum(ok)


@dataclass
class Records:
    """A per-round jsonl file as a resume reads it: its rows and a torn last line ('' if none)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    torn: str = ""


def read_records(path: Path) -> Records:
    """Every line of `path` (absent: none) must be a JSON object with a round number, except a last
    line without its newline, which a crash mid-write leaves (`torn`); raises ValueError naming the
    first other bad line."""
    if not path.is_file():
        return Records()
    try:
        *lines, last = path.read_bytes().decode("utf-8").split("\n")  # `last` is '' after a final newline
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 text (byte {e.start})") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        row = _row(line)
        if row is None:
            raise ValueError(f"line {number} is not a JSON object with a round number: {line[:60]!r}")
        rows.append(row)
    torn = ""
    if last:
        row = _row(last)
        if row is None:
            torn = last
        else:
            rows.append(row)
    return Records(rows, torn)


# the accuracies `round_statistics` summarises; a result file's metrics (`fedskew.reports.resultfile.METRICS`)
# name some of them by a short name
TRACKED = (
    "global-accuracy",
    "client-global-accuracy",
    "personalized-accuracy",
    "personalized-pooled-accuracy",
    "global-balanced-accuracy",
    "global-worst-class-accuracy",
    "personalized-central-accuracy",
    "personalized-held-accuracy",
    "personalized-missing-accuracy",
    # MuPFL's cluster reading: the returning client's start (its cluster-updated extractor with the
    # global classifier) before and after PKCF's classifier fine-tune, the model the paper evaluates
    "start-accuracy",
    "pkcf-accuracy",
)
LAST_ROUNDS = 10


def round_statistics(rows: list[dict[str, Any]], last: int = LAST_ROUNDS) -> dict[str, Any]:
    """Final value, best and mean of the last `last` rounds of each tracked accuracy in `rows`
    (`metrics.jsonl` lines): `final_<key>`, `best_<key>`, `last<last>_<key>` with `-` -> `_`, and
    for the global accuracy its std over those rounds (`last<last>_global_accuracy_round_std`).
    With per-class records: `last<last>_per_class_accuracy` (each class's mean over those rounds,
    None for a class absent from the test set) and `last<last>_worst_class`, the class whose mean is
    lowest (the worst class of single rounds changes from round to round).

    Label-skewed FL swings several points from round to round, so conclusions are drawn from the
    last-rounds mean; "final" is the last round's value (None when that round has none, e.g. no
    client had a local test split) and the mean runs over the rounds in (R - last, R] with a value.
    """
    final_round = max((int(r["round"]) for r in rows), default=0)
    out: dict[str, Any] = {}
    for key in TRACKED:
        name = key.replace("-", "_")
        points = [(int(r["round"]), float(r[key])) for r in rows if _finite(r.get(key))]
        tail = [v for rnd, v in points if rnd > final_round - last]
        out[f"final_{name}"] = points[-1][1] if points and points[-1][0] == final_round else None
        out[f"best_{name}"] = max(v for _, v in points) if points else None
        out[f"last{last}_{name}"] = float(np.mean(tail)) if tail else None
        if key == "global-accuracy":  # the oscillation FedRS reports: std over those rounds
            out[f"last{last}_{name}_round_std"] = float(np.std(tail)) if tail else None
    per_class = last_rounds_per_class(rows, "global-per-class-accuracy", last)
    worst = worst_class(per_class) if per_class is not None else None
    out[f"last{last}_per_class_accuracy"] = per_class
    out[f"last{last}_worst_class"] = None if worst is None else worst[0]
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def default_run_name(cfg: dict[str, Any], suffix: int | str) -> str:
    """`<method>-<dataset>-<partition>-s<seed>-<suffix>`, safe as a folder name."""
    return f"{cfg['method']}-{dataset_slug(cfg['dataset'])}-{cfg['partition']}-s{cfg['seed']}-{suffix}"


def saved_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` as `config.json` holds it (JSON values; `START_KEYS` false)."""
    return json.loads(json.dumps(_clean({**cfg, **dict.fromkeys(START_KEYS, False)})))


def config_changes(saved: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[str]:
    """The keys whose value in `cfg` differs from the `saved` config (a run's `config.json`),
    leaving out where things are (`PLACE_KEYS`), where copies of the metrics go (`OUTPUT_KEYS`) and
    how the run starts (`START_KEYS`); a key the saved config lacks (added to fedskew since) counts
    as its default."""
    now = saved_config(cfg)
    defaults = saved_config({k: p.default for k, p in all_params().items()})
    skip = {*PLACE_KEYS, *OUTPUT_KEYS, *START_KEYS, *foreign_keys(cfg.get("method"))}
    return sorted(k for k, v in now.items() if k not in skip and saved.get(k, defaults.get(k)) != v)


def read_saved(run_dir: Path) -> dict[str, Any] | None:
    """`run_dir`'s `config.json` as a mapping; None when it is missing, not JSON or not an object."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def changes_from(saved: dict[str, Any] | None, cfg: dict[str, Any]) -> str:
    """'' when the `saved` config (`read_saved`) is the config `cfg`, else why not (`config_changes`)."""
    if saved is None:
        return "config.json not readable"
    changes = config_changes(saved, cfg)
    return "" if not changes else "changed: " + ", ".join(changes)


def saved_changes(run_dir: Path, cfg: dict[str, Any]) -> str:
    """'' when `run_dir`'s `config.json` is the config `cfg`, else which keys differ (`config_changes`)."""
    return changes_from(read_saved(run_dir), cfg)


def foreign_keys(method: Any) -> set[str]:
    """Other methods' keys, which a run of `method` never reads (`fedskew.registry.config_keys`): a changed
    default of MAP's does not make a FedRoD run one computed under another config. None for a method
    that is not registered."""
    spec = METHODS.get(method) if isinstance(method, str) else None
    if spec is None:
        return set()
    return set(all_params()) - set(COMMON) - config_keys(spec)


def _results(run_dir: Path) -> list[str]:
    return [name for name in RESULTS if (run_dir / name).exists()]


def refuse_results(run_dir: Path, cfg: Mapping[str, Any]) -> None:
    """Raise ConfigError (one line) when `run_dir` holds an earlier run's results that a fresh start
    would replace, unless `overwrite` (they are then set aside)."""
    found = _results(run_dir)
    if not found or cfg["overwrite"]:
        return
    if cfg["resume"]:
        what = f"resume=true, but {run_dir} holds {', '.join(found)} and no checkpoint.pt to continue from"
    else:
        what = f"run-name={run_dir.name!r}: {run_dir} holds an earlier run's {', '.join(found)}"
    raise ConfigError(f"{what}; give another run-name, continue it with `fedskew run --resume {run_dir}`, {AFRESH}")


@dataclass
class Resume:
    """What a resume reads, checked: the checkpoint and the per-round files."""

    state: dict[str, Any]
    records: dict[str, Records]

    @property
    def round(self) -> int:
        return int(self.state["round"])


def resumes(run_dir: Path, cfg: Mapping[str, Any]) -> bool:
    """Whether a run with `cfg` continues from `run_dir`'s checkpoint."""
    return bool(cfg["resume"]) and (run_dir / "checkpoint.pt").is_file()


def read_resume(run_dir: Path, cfg: Mapping[str, Any]) -> Resume:
    """Read and check what resuming `run_dir` with `cfg` needs: `config.json` (`RESUME_FIXED` as in
    `cfg`), `checkpoint.pt` (round in [1, num-server-rounds], finite global arrays, strategy state)
    and the per-round files (rounds 1..R in order up to the checkpoint's round R). Raises ConfigError
    with one line naming the file and what to do."""

    def refuse(path: Path, what: str) -> ConfigError:
        return ConfigError(f"cannot resume from {path}: {what}; repair it, {AFRESH}")

    config = run_dir / "config.json"
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise refuse(config, f"not readable as JSON ({e})") from None
    if not isinstance(saved, dict):
        raise refuse(config, f"holds a {type(saved).__name__}, not a JSON object")
    for key in RESUME_FIXED:
        if key in saved and saved[key] != cfg[key]:
            raise ConfigError(
                f"resume: {key}={cfg[key]!r} does not match the checkpoint's {key}={saved[key]!r} ({config}); "
                f"keep {key}={saved[key]!r} or start another run"
            )
    path = run_dir / "checkpoint.pt"
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # a damaged file: pickle, zip, EOF or torch errors alike
        raise refuse(path, f"does not load ({type(e).__name__}: {str(e)[:100]})") from None
    problem = _checkpoint_problem(state, cfg["num-server-rounds"])
    if problem:
        raise refuse(path, problem)
    for key, value in state.get("run", {}).items():  # what it was written for (a config.json may be edited)
        if key in RESUME_FIXED and value != cfg[key]:
            raise ConfigError(
                f"resume: {key}={cfg[key]!r} does not match the checkpoint's {key}={value!r} ({path}); "
                f"keep {key}={value!r} or start another run"
            )
    resume = Resume(state, {})
    for name in RECORDS:
        try:
            records = read_records(run_dir / name)
        except ValueError as e:
            raise refuse(run_dir / name, str(e)) from None
        rounds = [row["round"] for row in records.rows if row["round"] <= resume.round]
        if name != "failures.jsonl" and rounds != list(range(1, resume.round + 1)):
            shown = ", ".join(map(str, rounds[:12])) + (" ..." if len(rounds) > 12 else "")
            raise refuse(run_dir / name, f"holds rounds [{shown}], not 1..{resume.round} of the checkpoint")
        if rounds != sorted(rounds):
            raise refuse(run_dir / name, "its rounds are out of order")
        resume.records[name] = records
    return resume


def _checkpoint_problem(state: Any, rounds: int) -> str:
    """What is wrong with a loaded checkpoint ('' if nothing)."""
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a checkpoint"
    r = state.get("round")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return f"round={r!r} is not a round number"
    if r > rounds:
        return f"it is after round {r} but num-server-rounds={rounds} (give num-server-rounds >= {r})"
    arrays = state.get("arrays")  # empty for a method without a global model (FedProto): `check_fits` decides
    if not isinstance(arrays, dict):
        return "holds no global model arrays"
    for name, value in arrays.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            return f"array {name!r} is a {type(value).__name__}, not a tensor"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"array {name!r} holds NaN or inf"
    for key in ("strategy", "metrics", "run"):
        if not isinstance(state.get(key, {}), dict):
            return f"{key!r} is a {type(state[key]).__name__}, not a mapping"
    for name, value in state.get("strategy", {}).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"strategy state {name!r} holds NaN or inf"
    return ""


def check_fits(state: dict[str, Any], strategy: Any, path: Path) -> None:
    """The checkpoint's global arrays have the names, shapes and dtypes of `strategy`'s model, and
    its strategy state loads into `strategy` (which then holds it); else ConfigError."""
    from flwr.app import ArrayRecord

    def spec(record: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in record.items()}

    want, got = spec(strategy.initial_arrays()), spec(ArrayRecord(state["arrays"]))
    if want != got:
        name = next(k for k in sorted({*want, *got}) if want.get(k) != got.get(k))
        what = f"array {name!r} is {got.get(name)}, the model's is {want.get(name)}"
        raise ConfigError(f"cannot resume from {path}: it does not fit the configured model ({what}); {AFRESH}")
    try:
        strategy.load_state_dict(state.get("strategy", {}))
    except Exception as e:  # whatever the method's own restore raises on a state it did not write
        what = f"{type(e).__name__}: {str(e)[:100]}"
        raise ConfigError(f"cannot resume from {path}: its strategy state does not load ({what}); {AFRESH}") from None


def quiet_strategy(cfg: dict[str, Any]) -> Any:
    """The configured method's strategy on the CPU, built without Flower's start-up warnings (to
    check a checkpoint against it before anything starts)."""
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(logging.ERROR)
    try:
        return get_method(cfg["method"]).strategy_class()(cfg, torch.device("cpu"))
    finally:
        flower.setLevel(level)


def check_run_folder(run_dir: Path, cfg: dict[str, Any]) -> None:
    """Up front (the launcher), what `RunOutput` will refuse: an out-dir that cannot be a folder,
    earlier results without resume or overwrite, or anything a resume would find wrong."""
    check_folder(run_dir, "out-dir")
    if resumes(run_dir, cfg):
        check_fits(read_resume(run_dir, cfg).state, quiet_strategy(cfg), run_dir / "checkpoint.pt")
    else:
        refuse_results(run_dir, cfg)


def set_aside(run_dir: Path, move: Iterable[str], copy: Iterable[str], reason: str) -> Path:
    """Move the files `move` and copy the files `copy` of `run_dir` into a new folder
    `run_dir/aside-<local time>-<random>/` with a `reason.txt`; return that folder."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = Path(tempfile.mkdtemp(prefix=f"aside-{stamp}-", dir=run_dir))  # a new folder, never an earlier one
    for name in copy:
        data = (run_dir / name).read_bytes()
        atomic_write(aside / name, lambda f, data=data: f.write(data))
    for name in move:
        os.replace(run_dir / name, aside / name)
    (aside / "reason.txt").write_text(reason + "\n")
    return aside


class RunOutput:
    """The results folder of one run. Nothing is written until every check has passed: a fresh
    start refuses a folder with earlier results unless `overwrite` (they are then set aside); a
    resume reads and checks its files here and continues in `resume`."""

    def __init__(self, cfg: dict[str, Any], run_id: int | str) -> None:
        name = cfg["run-name"] or default_run_name(cfg, run_id)
        self.dir = Path(cfg["out-dir"]).expanduser().absolute() / name
        self.cfg = cfg
        check_folder(self.dir, "out-dir")
        self.pending: Resume | None = None
        self.resumed_after: int | None = None  # marks the first timings row after a resume
        self.node_states_restored = False  # the engine put the nodes' states of the resumed round back
        if resumes(self.dir, cfg):
            self.pending = read_resume(self.dir, cfg)
            return
        refuse_results(self.dir, cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        earlier = [name for name in RUN_FILES if (self.dir / name).exists()]
        earlier += sorted(p.name for p in self.dir.glob(EVENT_FILES))  # its TensorBoard curves
        if cfg["overwrite"] and earlier:
            aside = set_aside(self.dir, earlier, (), "overwrite=true: a new run started afresh in this folder")
            log.warning("fedskew: overwrite=true: the earlier run's files are moved to %s", aside)
        write_json(self.dir / "config.json", saved_config(cfg))

    def resume(self, strategy: Any) -> dict[str, Any] | None:
        """With resume: check the checkpoint against `strategy` and load its state into it, cut the
        per-round files back to the checkpoint's round (the originals copied aside first, as are an
        earlier finish's summary and model, or an earlier stop's record); return the checkpoint. None
        when not resuming."""
        if self.pending is None:
            return None
        r, path = self.pending, self.dir / "checkpoint.pt"
        check_fits(r.state, strategy, path)
        cut = [name for name, rec in r.records.items() if rec.torn or any(row["round"] > r.round for row in rec.rows)]
        finished = [name for name in ("summary.json", "stopped.json", "model.pt") if (self.dir / name).exists()]
        if cut or finished:
            reason = f"resume after round {r.round}: the files as they were ({', '.join([*cut, *finished])})"
            aside = set_aside(self.dir, finished, cut, reason)
            log.warning("fedskew: resume after round %d: %s kept in %s", r.round, ", ".join([*cut, *finished]), aside)
        for name in cut:
            text = "".join(
                json.dumps(_clean(row), sort_keys=True) + "\n"
                for row in r.records[name].rows
                if row["round"] <= r.round
            )
            atomic_write(self.dir / name, lambda f, text=text: f.write(text.encode()))
        write_json(self.dir / "config.json", saved_config(self.cfg))
        self.pending, self.resumed_after = None, r.round
        return r.state

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write `checkpoint.pt` atomically and durably (tensors and plain values only)."""
        atomic_write(self.dir / "checkpoint.pt", lambda f: torch.save(state, f))

    def log_round(self, metrics: dict[str, Any], timings: dict[str, Any], failures: list[dict[str, Any]] = ()) -> None:
        """Append the round's metrics, timings and lost replies (`failures.jsonl`); the first timings
        row after a resume from round R holds `resumed-after`: R (`resumed_rounds`), and
        `node-states-restored`: true where the engine put the nodes' states back."""
        append_jsonl(self.dir / "metrics.jsonl", metrics)
        if self.resumed_after is not None:
            mark = {"resumed-after": self.resumed_after}
            if self.node_states_restored:
                mark["node-states-restored"] = True
            timings, self.resumed_after = {**timings, **mark}, None
        append_jsonl(self.dir / "timings.jsonl", timings)
        self.log_failures(metrics["round"], failures)

    def log_failures(self, server_round: int, failures: list[dict[str, Any]]) -> None:
        """Append lost replies (node, partition, reason, attempt) to `failures.jsonl`."""
        for f in failures:
            append_jsonl(self.dir / "failures.jsonl", {"round": server_round, **f})

    def finish(
        self,
        summary: dict[str, Any],
        state_dict: dict[str, torch.Tensor] | None,
        class_labels: list[str] | None = None,
        plots: bool = True,
    ) -> Any:
        """Write `model.pt` (not for a method without a global model: `state_dict` None) and, with
        `plots`, the accuracy plot and `per-class.png` (with `class_labels` on its class axis); return
        the per-class figure (None without per-class records or plots), for the trackers.
        `write_summary` comes after the trackers have closed: a run is complete once its summary is
        there, every other file written."""
        if state_dict is not None:
            model = {k: v.cpu() for k, v in state_dict.items()}
            atomic_write(self.dir / "model.pt", lambda f: torch.save(model, f))
        if not plots:
            return None
        rows = read_jsonl(self.dir / "metrics.jsonl")
        plot_accuracy(rows, self.dir / "accuracy.png", summary.get("method", ""))
        figure = per_class_figure(rows, f"{summary.get('method', '')}: global model, accuracy per class", class_labels)
        (self.dir / "per-class.png").unlink(missing_ok=True)
        if figure is not None:
            figure.savefig(self.dir / "per-class.png", dpi=100)
        return figure

    def write_stopped(self, server_round: int, reason: str, ran: dict[str, Any]) -> None:
        """`stopped.json`: the run stopped at `server_round`, which no retry could complete (`reason`),
        with what `summary.json` says of where it ran (`ran`: method revision, device, processor). Its
        rows hold rounds 1..`server_round` - 1; the export keeps it as a seed that stopped
        (`fedskew.reports.resultfile`), so a diverged run is counted, not silently left out."""
        write_json(self.dir / "stopped.json", {**ran, "round": server_round, "reason": reason})

    def write_summary(self, summary: dict[str, Any]) -> None:
        """`summary.json`, the run's last file (the launcher and the suites take it for the run's end)."""
        write_json(self.dir / "summary.json", summary)


def plot_accuracy(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Global, client-global (the global model on the clients' test splits) and personalized
    accuracy against the round (integer ticks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("global-accuracy", "global"),
        ("client-global-accuracy", "client-global"),
        ("personalized-accuracy", "personalized"),
    ):
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def per_class_figure(rows: list[dict[str, Any]], title: str, class_labels: list[str] | None = None) -> Any:
    """Heatmap of the global model's per-class accuracy: one row per class, one column per evaluated
    round, absent classes grey; None when `rows` hold no per-class record."""
    import matplotlib
    from matplotlib.figure import Figure  # not pyplot: no global state
    from matplotlib.ticker import MaxNLocator

    points = {r["round"]: r["global-per-class-accuracy"] for r in rows if r.get("global-per-class-accuracy")}
    if not points:
        return None
    first, last = min(points), max(points)
    c = len(points[last])
    grid = np.full((c, last - first + 1), np.nan)  # rounds not evaluated (eval-every) stay grey
    for r, acc in points.items():
        grid[:, r - first] = [np.nan if v is None else v for v in acc[:c]]
    labels = class_labels if class_labels is not None and len(class_labels) == c else [str(i) for i in range(c)]
    fig = Figure(figsize=(min(16.0, 5.0 + 0.12 * grid.shape[1]), min(16.0, 1.8 + 0.28 * c)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        origin="lower",
        cmap=matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey"),
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
        extent=(first - 0.5, last + 0.5, -0.5, c - 0.5),
    )
    step = max(1, c // 25)
    ax.set_yticks(range(0, c, step), [labels[i] for i in range(0, c, step)], fontsize=8 if c <= 25 else 6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("class")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="accuracy")
    return fig


def class_labels(num_classes: int, skew: dict[str, Any] | None, groups: dict[str, list[int]] | None) -> list[str]:
    """The class axis of `per-class.png`: each class id, with its long-tail group (`frequency_groups`)
    and, for a class one client holds for the most part (`partition_skew`), that client and its share."""
    labels = [str(c) for c in range(num_classes)]
    for name, classes in (groups or {}).items():
        for c in classes:
            labels[c] += f" {name}"
    for d in skew["dominated-classes"] if skew else []:
        if d["class"] < num_classes:
            labels[d["class"]] += f" ({100 * d['share']:.0f} % client {d['client']})"
    return labels
