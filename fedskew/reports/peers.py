"""The peers' published numbers beside ours: the generated table of `docs/notes/peers.md`.

`results/peers/published.yaml` holds each peer's numbers as printed in its repository (file and
commit), the fedskew suite that runs its protocol and, per method, the statistic of ours that
compares (`ours`). A row's gap is ours - theirs with Welch's 95 % interval
(`fedskew.reports.stats.welch_interval`): unpaired, since their runs and our seeds share nothing; their
std is taken as the sample std of `runs` runs (the count a peer states, or the one its numbers
imply), ours as the population std over our seeds. A row whose interval excludes 0 lies outside the
seeds' spread and needs its reason under `gaps` (fedskew's reading, not the peer's); the table says
so where none is written yet. Under `beside`, a setting names our other settings whose numbers stand
beside ours, each with a caption and its own gap: where the peer's runs share one split, the same
cell on a split drawn per seed (what the split alone moves); the peer's network and inputs in place
of fedskew's (what they alone move). Under `variants`, a method names other cells of our suite that
run it with some key changed (a diagnostic: what that key alone moves), shown the same way in each
setting; those gaps are not bold, since only the row's own asks for a reason. A peer's `reference`
adds there its own code run here (`reference_runs`). A cell whose recorded config is not what the
suite gives today names the keys that changed: its numbers are of the earlier protocol until the
suite runs it again.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedskew.config import ConfigError, all_params, validate
from fedskew.reports.markdown import md
from fedskew.reports.pages import fmt_value
from fedskew.reports.resultfile import (
    STAT_NAME,
    ResultSet,
    Stat,
    percent_value,
    recorded_time,
    refused,
    seed_stat,
    stopped_text,
    suite_config,
)
from fedskew.reports.stats import Interval, welch_interval

PUBLISHED = Path("results/peers/published.yaml")
BLOCK = "peers"  # docs/notes/peers.md's `<!-- report:peers begin -->` block


@dataclass(frozen=True)
class PeerRow:
    peer: str
    setting: str  # the peer's name for it
    method: str
    theirs: tuple[float, float, int]  # mean, sample std, runs
    stat: str  # ours: `<metric>.<stat>`
    ours: Stat | None  # None: our suite has not run the cell
    seeds: int
    reason: str
    changed: tuple[str, ...] = ()  # the keys whose value differs from the suite's today, as "key old → new"
    beside: tuple[Beside, ...] = ()  # ours in the settings `beside` names for this one
    stopped: str = ""  # ours: the seeds whose run stopped, and at which round (`stopped_text`)
    suite: str = ""  # our suite's name (its result file's stem)

    @property
    def gap(self) -> Interval | None:
        """ours - theirs with Welch's interval (None before our cell has 2 seeds)."""
        return gap_interval(self.theirs, self.ours, self.seeds)


@dataclass(frozen=True)
class Beside:
    """Ours in another setting of the suite, shown beside the row's: its caption, statistic, seeds."""

    caption: str
    ours: Stat
    seeds: int


def gap_interval(theirs: tuple[float, float, int], ours: Stat | None, seeds: int) -> Interval | None:
    """ours - theirs with Welch's interval, their std taken as a sample std over their runs (None
    before ours has 2 seeds)."""
    if ours is None or ours.std is None:
        return None
    mean, sample_std, runs = theirs
    pop = sample_std * math.sqrt((runs - 1) / runs)
    return welch_interval((ours.mean, ours.std, seeds), (mean, pop, runs))


def gap_text(theirs: tuple[float, float, int], ours: Stat, seeds: int, mark: bool = True) -> str:
    """The gap with its interval, bold where it excludes 0 if `mark` (a row's own gap, which then needs
    a reason); with one seed the bare difference."""
    iv = gap_interval(theirs, ours, seeds)
    if iv is None:
        return f"{ours.mean - theirs[0]:+.2f}" + (" (one seed: no interval)" if seeds < 2 else "")
    return f"**{iv.text()}**" if mark and iv.excludes_zero() else iv.text()


def _need(raw: Any, key: str, kind: type, where: str) -> Any:
    value = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: `{key}` must be a {kind.__name__} (got {value!r})")
    return value


def _theirs(path: Path, where: str, num: Any, runs: int) -> tuple[float, float, int]:
    """A published {mean, std} (percent, as printed) with the runs it is over."""
    if not isinstance(num, dict):
        raise refused(path, where, num, "must be a mapping {mean, std} (percent)")
    mean, std = (percent_value(path, f"{where}.{key}", num.get(key)) for key in ("mean", "std"))
    return mean, std, runs


def reference_runs(
    root: Path, raw: Any, where: str, path: Path, settings: dict[str, str]
) -> dict[tuple[str, str], Beside]:
    """A peer's `reference`, {file, caption}: the peer's own code run here (a file of
    `benchmarks/niid_bench_reference.py --export`: `setting`, and per method each seed's statistic in
    percent), as (setting, method) -> what stands beside our row; {} without one or before it ran."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not isinstance(raw.get("file"), str) or not isinstance(raw.get("caption"), str):
        raise refused(path, where, raw, "must be {file: a path under results/peers/, caption: text}")
    file = root / raw["file"]
    if not raw["file"].startswith("results/peers/") or ".." in Path(raw["file"]).parts:
        raise refused(path, f"{where}.file", raw["file"], "must be a path under results/peers/")
    if not file.is_file():
        return {}
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
    setting = data.get("setting") if isinstance(data, dict) else None
    if setting not in settings:
        raise refused(file, "setting", setting, f"must be one of the peer's settings {sorted(settings)}")
    out = {}
    for method, by_seed in _need(data, "best", dict, str(file)).items():
        ok = isinstance(by_seed, dict) and by_seed and all(type(s) is int for s in by_seed)
        if not ok:
            raise refused(file, f"best.{method}", by_seed, "must map integer seeds to a percentage")
        values = [percent_value(file, f"best.{method}.{s}", v) for s, v in sorted(by_seed.items())]
        out[setting, str(method)] = Beside(raw["caption"], seed_stat(values), len(values))
    return out


def config_changes(recorded: dict[str, Any], today: dict[str, Any]) -> tuple[str, ...]:
    """'key old → new' for each key a run reads whose value differs between the two cell configs once
    fedskew's defaults fill them in (`fedskew.server_app.results.config_changes`, the rule a resumed
    run and a suite's "changed" cell use); ('recorded config no longer valid',) when it is not one."""
    from fedskew.server_app.results import config_changes as changed_keys  # late: that module imports torch
    from fedskew.server_app.results import saved_config

    defaults = {k: p.default for k, p in all_params().items()}
    try:
        old, new = validate({**defaults, **recorded}), validate({**defaults, **today})
    except ConfigError as e:
        return (f"recorded config no longer valid: {e}",)
    return tuple(f"{k} {old[k]} → {new[k]}" for k in changed_keys(saved_config(old), new))


def _caption_maps(raw: Any) -> bool:
    """Whether `raw` maps each key to a {label: caption} map of strings (`beside`, `variants`)."""
    return isinstance(raw, dict) and all(
        isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())
        for v in raw.values()
    )


def load_rows(root: Path, sets: dict[str, ResultSet]) -> list[PeerRow]:
    """Every (peer, setting, method) of the published file, with our cell from `sets` where it ran.
    Raises ConfigError naming the key of anything the table could not show as it is."""
    path = root / PUBLISHED
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if _need(raw, "format", int, str(path)) != 1:
        raise ConfigError(f"{path}: format {raw['format']!r} (this reader knows 1)")
    rows = []
    for key, peer in _need(raw, "peers", dict, str(path)).items():
        where = f"{path}: peers.{key}"
        suite_path = root / _need(peer, "suite", str, where)
        suite = suite_path.stem
        try:  # the suite's cell configs today, to name what changed since a cell was recorded
            suite_raw = yaml.safe_load(suite_path.read_text()) if suite_path.is_file() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"{suite_path}: not valid YAML ({str(e).splitlines()[0]})") from None
        settings = _need(peer, "settings", dict, where)
        ours = _need(peer, "ours", dict, where)
        runs = _need(peer, "runs", int, where)
        if isinstance(runs, bool) or runs < 2:
            raise refused(path, f"peers.{key}.runs", runs, "must be an integer >= 2 (a std needs two runs)")
        beside = peer.get("beside") or {}
        if not _caption_maps(beside) or not set(beside) <= set(settings):
            raise refused(
                path, f"peers.{key}.beside", beside, "must map a setting label to {our setting label: caption}"
            )
        variants = peer.get("variants") or {}
        if not _caption_maps(variants):
            raise refused(
                path, f"peers.{key}.variants", variants, "must map a method to {our suite's method label: caption}"
            )
        here = reference_runs(root, peer.get("reference"), f"peers.{key}.reference", path, settings)
        gaps = peer.get("gaps") or {}
        if not isinstance(gaps, dict) or not all(isinstance(g, dict) for g in gaps.values()):
            raise refused(path, f"peers.{key}.gaps", gaps, "must map a method to {setting: reason}")
        results = sets.get(suite)
        published = _need(peer, "rows", dict, where)
        for method, by_setting in published.items():
            if method not in ours:
                raise ConfigError(f"{where}: method {method!r} has no statistic under `ours`")
            if not isinstance(ours[method], str) or not STAT_NAME.fullmatch(ours[method]):
                raise refused(path, f"peers.{key}.ours.{method}", ours[method], "must be a statistic <metric>.<stat>")
            if not isinstance(by_setting, dict):
                raise refused(path, f"peers.{key}.rows.{method}", by_setting, "must map a setting to {mean, std}")
            if unknown := set(by_setting) - set(settings):
                raise ConfigError(f"{where}: rows.{method}: settings {sorted(unknown)} not under `settings`")
        if unknown := set(variants) - set(published):
            raise ConfigError(f"{where}: variants: methods {sorted(unknown)} not under `rows`")
        for label in settings:  # grouped by setting, as the peers print them
            for method in (m for m, by_setting in published.items() if label in by_setting):
                num = _theirs(path, f"peers.{key}.rows.{method}.{label}", published[method][label], runs)
                cell = results.cell(label, method) if results is not None else None
                stat = cell.stats.get(ours[method]) if cell is not None else None
                others = []  # our other settings of this method, then this setting's variants of it
                for (other_label, other_method), caption in [
                    *(((b, method), c) for b, c in (beside.get(label) or {}).items()),
                    *(((label, v), c) for v, c in (variants.get(method) or {}).items()),
                ]:
                    other = results.cell(other_label, other_method) if results is not None else None
                    if other is not None and (other_stat := other.stats.get(ours[method])) is not None:
                        others.append(Beside(caption, other_stat, len(other.seeds)))
                if (label, method) in here:
                    others.append(here[label, method])
                changed = ()
                if cell is not None and cell.config is not None and isinstance(suite_raw, dict):
                    changed = config_changes(cell.config, suite_config(suite_raw, label, method))
                rows.append(
                    PeerRow(
                        peer=key,
                        setting=settings[label],
                        method=method,
                        theirs=num,
                        stat=ours[method],
                        ours=stat,
                        seeds=len(cell.seeds) if cell is not None else 0,
                        reason=str((gaps.get(method) or {}).get(label, "")),
                        changed=changed,
                        beside=tuple(others),
                        stopped=stopped_text(cell) if cell is not None else "",
                        suite=suite,
                    )
                )
    return rows


def peers_table(rows: list[PeerRow]) -> list[str]:
    """The summary table: theirs, ours, the gap with its interval, ours in the settings beside it (each
    with its gap), and the gap's reason."""
    lines = [
        "| peer | setting | method | theirs | ours (statistic, seeds) | ours - theirs [95% interval] "
        "| beside: ours (seeds), ours - theirs | reason for a gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mean, std, _ = r.theirs
        stat = f"`{r.stat}`"  # a statistic's name (`load_rows` checks it): no Markdown in it
        if r.ours is None:  # seeds > 0: the cell ran, but its recorded runs do not measure this statistic
            seeds = f"{r.seeds} recorded seed{'s' if r.seeds > 1 else ''}"
            ours = f"not measured by its {seeds} ({stat})" if r.seeds else f"not run yet ({stat})"
            gap, reason = "", md(r.reason)
        else:
            ours = f"{fmt_value(r.ours)} ({stat}, {r.seeds})"
            gap = gap_text(r.theirs, r.ours, r.seeds)
            outside = (iv := r.gap) is not None and iv.excludes_zero()
            reason = md(r.reason) or ("**outside the spread: no reason written yet**" if outside else "")
            if r.stopped:  # a diverged run counts with the rounds it ran
                ours += f"; {r.stopped}, its statistic over the rounds before"
            if r.changed:  # the numbers of an earlier protocol, until the suite runs the cell again
                ours += f"; recorded under an earlier config ({md(', '.join(r.changed))}), to run again"
        beside = "; ".join(
            f"{md(b.caption)}: {fmt_value(b.ours)} ({b.seeds}), {gap_text(r.theirs, b.ours, b.seeds, mark=False)}"
            for b in r.beside
        )
        lines.append(
            f"| {md(r.peer)} | {md(r.setting)} | {md(r.method)} | {mean:.2f} ± {std:.2f} | {ours} | {gap} | {beside} "
            f"| {reason} |"
        )
    return lines


def cost_line(rows: list[PeerRow], sets: dict[str, ResultSet]) -> str:
    """'Where ours ran and how long ...: <suite>: cpu, 2.8 h over 4 runs, a run 40-45 min (median 42).'
    from each peer suite's recorded devices and wall times ('' before any run is timed)."""
    parts = []
    for suite in dict.fromkeys(r.suite for r in rows):
        devices, walls, runs = recorded_time(results.cells if (results := sets.get(suite)) is not None else [])
        if not walls:
            continue
        timed = f"{runs} runs" if len(walls) == runs else f"the {len(walls)} of {runs} runs timed"
        minutes = f"{min(walls) / 60:.0f}-{max(walls) / 60:.0f} min (median {statistics.median(walls) / 60:.0f})"
        where = ", ".join(map(md, devices)) or "device not recorded"
        parts.append(f"{md(suite)}: {where}, {sum(walls) / 3600:.1f} h over {timed}, a run {minutes}")
    if not parts:
        return ""
    return (
        "Where ours ran and how long (each run's wall time, as its result file records; the CPU queue runs "
        f"two at once): {'; '.join(parts)}."
    )


def peers_block(root: Path, sets: dict[str, ResultSet]) -> list[str]:
    """docs/notes/peers.md's generated block (`BLOCK`): the summary table, then what our runs cost."""
    rows = load_rows(root, sets)
    cost = cost_line(rows, sets)
    return [*peers_table(rows), *(["", cost] if cost else [])]
