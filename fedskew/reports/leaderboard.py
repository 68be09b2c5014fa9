"""The leaderboard's pages: `docs/leaderboard.md`, README's headline table and
`docs/img/leaderboard-gain.png`, from the suite `suites/leaderboard.yaml` (every method on the
standard label-skew settings) and its result file `results/leaderboard.yaml`.

Every gain is a method's last-k mean minus FedAvg's, paired by seed, with its 95 % Student-t interval
(`fedskew.reports.stats`); bold where the interval excludes 0, marked where Holm's correction over
the setting's methods keeps it. Beside it: each method's chance of the top 3 over seed resamples, the
seeds a setting's spread asks for, the best round against the last-k mean, and a converged budget's
gains with the rank correlation between the two budgets (`suites/leaderboard-converged.yaml`); until
that has run, the same on the seeds of the leading methods' long runs (`suites/leaderboard-long.yaml`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.config import all_params
from fedskew.reports.markdown import md, md_code_block
from fedskew.reports.pages import GENERATED, fmt_value, save_figure
from fedskew.reports.resultfile import (
    CellResult,
    ResultSet,
    per_seed_values,
    recorded_time,
    stopped_text,
    suite_seeds,
)
from fedskew.reports.stats import (
    LEVEL,
    Interval,
    holm,
    paired_gain,
    rank_correlation,
    seeds_needed,
    t_pvalue,
    t_quantile,
    top_k_chance,
)

LEADERBOARD_SUITE = Path("suites/leaderboard.yaml")
CONVERGED_SUITE = Path("suites/leaderboard-converged.yaml")  # the same methods at a converged budget
CONVERGED_RUNS = Path("suites/leaderboard-long.yaml")  # the leading methods' long runs that chose it

LEADERBOARD_STATS = ("global", "balanced", "worst-class", "personalized")
BASELINE = "fedavg"
TOP = 3  # the rank whose chance the page gives
HOLM_MARK = "†"  # after a bold gain that Holm's correction over the setting keeps
NO_GLOBAL = "no global model"  # a gain cell of a method whose runs log no global accuracy


@dataclass
class Board:
    """The leaderboard suite (its YAML) and its result file, with the paired statistics of its pages."""

    suite: dict[str, Any]
    results: ResultSet | None

    @property
    def last(self) -> int:
        return int(self.suite.get("last-rounds", 10))

    @property
    def methods(self) -> list[str]:
        return list(self.suite.get("methods") or {})

    @property
    def partitions(self) -> list[str]:
        return list(self.suite.get("partitions") or {})

    @property
    def rounds(self) -> int | None:
        return (self.suite.get("base") or {}).get("num-server-rounds")

    def cell(self, partition: str, method: str) -> CellResult | None:
        return self.results.cell(partition, method) if self.results else None

    def values(self, partition: str, method: str, stat: str = "") -> dict[int, float] | None:
        """Seed -> value of `stat` (default: the global accuracy's last-k mean) of one cell."""
        stat = stat or f"global.last{self.last}"
        cell = self.cell(partition, method)
        return per_seed_values(cell, stat) if cell is not None and stat in cell.stats else None

    def means(self, partition: str, stat: str = "") -> dict[str, float]:
        """Method -> mean over its seeds of `stat` (default: the global accuracy's last-k mean), for
        the methods of the setting that have it."""
        stat = stat or f"global.last{self.last}"
        return {m: c.stats[stat].mean for m in self.methods if (c := self.cell(partition, m)) and stat in c.stats}

    def gain(self, partition: str, method: str, stat: str = "") -> Interval | None:
        """`method`'s gain over FedAvg in `stat`, paired by seed (None: no shared seed or no value)."""
        mine, base = self.values(partition, method, stat), self.values(partition, BASELINE, stat)
        if mine is None or base is None or method == BASELINE:
            return None
        return paired_gain(mine, base)

    def no_global(self, partition: str, method: str) -> bool:
        """The cell ran but its method keeps no global model (its runs log no global accuracy)."""
        cell = self.cell(partition, method)
        return cell is not None and f"global.last{self.last}" not in cell.stats

    def holm_kept(self, partition: str, stat: str = "") -> set[str]:
        """The methods whose paired gain over FedAvg there stays established under Holm's correction
        over all the setting's comparisons (`fedskew.reports.stats.holm`)."""
        gains = {m: iv for m in self.methods if (iv := self.gain(partition, m, stat)) is not None}
        return holm({m: t_pvalue(iv) for m, iv in gains.items()})

    def seeds(self, partition: str) -> list[int]:
        """The setting's seeds: FedAvg's there (every gain is paired with them)."""
        base = self.values(partition, BASELINE)
        return sorted(base) if base else []

    def planned(self, partition: str) -> int:
        """How many seeds the suite runs the setting with (`resultfile.suite_seeds`, as `load_suite`)."""
        return len(suite_seeds(self.suite, partition))

    def top_chance(self, partition: str, stat: str = "") -> dict[str, float]:
        """Each method's chance of ranking in the top `TOP` of the setting over seed resamples, on the
        seeds every method run there holds (a seed some cells have not reached yet is left out, so
        that every method takes part in the ranking)."""
        values = {m: v for m in self.methods if (v := self.values(partition, m, stat))}
        if not values:
            return {}
        seeds = set.intersection(*(set(v) for v in values.values()))
        full = {m: {s: v[s] for s in seeds} for m, v in values.items()}
        return top_k_chance(full, TOP) if seeds and len(full) > TOP else {}

    def gain_sds(self, partition: str) -> list[float]:
        """The std over seeds of every method's paired gain there (n >= 3)."""
        out = []
        for m in self.methods:
            iv = self.gain(partition, m)
            if iv is not None and iv.n >= 3:
                out.append(iv.sd)
        return out


def _lb_value(cell: CellResult | None, metric: str, last: int) -> str:
    if cell is None or f"{metric}.last{last}" not in cell.stats:
        return "n/a"
    return fmt_value(cell.stats[f"{metric}.last{last}"])


def _gain_cell(iv: Interval | None, kept: bool = False) -> str:
    """'**+3.2 [+1.1, +5.3]**' (bold: the interval excludes 0; followed by `HOLM_MARK` where `kept`
    under Holm's correction), '-' without one."""
    if iv is None:
        return "-"
    return f"**{iv.text()}**{HOLM_MARK if kept else ''}" if iv.excludes_zero() else iv.text()


def _board_gain_cell(board: Board, partition: str, method: str, kept: set[str]) -> str:
    """A leaderboard table's gain cell: `_gain_cell`, or `NO_GLOBAL` (`Board.no_global`)."""
    if board.no_global(partition, method):
        return NO_GLOBAL
    return _gain_cell(board.gain(partition, method), method in kept)


def holm_sentence(board: Board) -> str:
    """What the intervals alone risk over a setting's many comparisons, and the mark for what survives."""
    m = max((len([x for x in board.methods if board.gain(p, x) is not None]) for p in board.partitions), default=0)
    return (
        f"With {m} intervals a setting at {LEVEL:.0%}, {(1 - LEVEL) * m:.2g} of them are expected to exclude 0 by "
        f"chance alone if no method differed from FedAvg; {HOLM_MARK} marks a gain that also holds under Holm's "
        f"correction over the setting's comparisons (a chance of at most {1 - LEVEL:.0%} that any marked verdict of "
        "a setting is wrong)."
    )


def _seed_count(board: Board, partition: str) -> str:
    counts = sorted({len(c.seeds) for m in board.methods if (c := board.cell(partition, m)) is not None})
    return "/".join(map(str, counts)) or "0"


def _named(methods: list[str]) -> str:
    """'2 (fedrs, creff)', '0'."""
    return f"{len(methods)} ({', '.join(map(md, methods))})" if methods else "0"


def leaderboard_verdict(board: Board) -> str:
    """One line per setting: which methods beat FedAvg (their paired interval above 0), which fall
    below it, and the most likely top three ('' before any result)."""
    parts = []
    for p in board.partitions:
        gains = {m: iv for m in board.methods if (iv := board.gain(p, m)) is not None}
        if not gains:
            continue
        above = [m for m, iv in gains.items() if iv.sign() > 0]
        below = [m for m, iv in gains.items() if iv.sign() < 0]
        kept = board.holm_kept(p)
        chance = board.top_chance(p)
        likely = sorted(chance, key=lambda m: -chance[m])[:TOP]
        top = ", ".join(f"{md(m)} {chance[m]:.0%}" for m in likely)
        parts.append(
            f"**{md(p)}** ({len(board.seeds(p))} seeds): {len(above)} of {len(gains)} methods above FedAvg "
            f"({', '.join(map(md, above)) or 'none'}), {len(below)} below; under Holm's correction "
            f"{_named([m for m in above if m in kept])} above and {_named([m for m in below if m in kept])} below; "
            f"chance of the top {TOP}: {top or 'n/a'}"
        )
    return ("; ".join(parts) + ".") if parts else ""


def seeds_section(board: Board) -> list[str]:
    """How many seeds the cells have, and how many a given difference needs (from the measured spread)."""
    lines = [
        "## Seeds: how many, and why",
        "",
        f"A gain's {LEVEL:.0%} interval has the half-width t(n-1) sd / sqrt(n), sd the std of the paired "
        "per-seed gains. From their median sd in each setting: the half-width the cells' seeds give, and the "
        "seeds a difference of 2 and of 1 point needs to be told from 0.",
        "",
        "| setting | seeds | planned | median sd of a paired gain | half-width now | seeds for +-2 | seeds for +-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    need: dict[str, int] = {}
    for p in board.partitions:
        sds, n = board.gain_sds(p), len(board.seeds(p))
        if not sds or n < 2:
            continue
        sd = float(np.median(sds))
        width = t_quantile(n) * sd / math.sqrt(n)
        need[p] = seeds_needed(sd, 2.0)
        lines.append(
            f"| {md(p)} | {_seed_count(board, p)} | {board.planned(p)} | {sd:.2f} | {width:.2f} | {need[p]} "
            f"| {seeds_needed(sd, 1.0)} |"
        )
    said = (
        f"Planned: the seeds the suite runs a setting with (its `seeds:`, {len(board.suite.get('seeds') or [])}, "
        "or the setting's own under `partitions:`), at least 10"
    )
    short = [f"{md(p)} {board.planned(p)} of {n}" for p, n in need.items() if board.planned(p) < n]
    if short:
        said += f"; at today's spread they fall short of the column for +-2 in {', '.join(short)}"
    elif need:
        said += "; at today's spread they cover the column for +-2 in every setting"
    return [*lines, "", said + ".", ""]


def budget_section(board: Board, long: Board | None, first: Board | None = None) -> list[str]:
    """The short budget's gains beside a converged budget's (`long`, the same settings), and the rank
    correlation of the methods' last-k means between the two: which verdicts depend on the budget.
    Before `long` has run: `first_look` at the convergence runs (`first`), when they have."""
    lines = [f"## Budget: {board.rounds} rounds against a converged budget", ""]
    if long is None or long.results is None or not long.results.cells:
        return [
            *lines,
            f"**Not run yet.** At {board.rounds} rounds the last-{board.last} mean may still drift (see the table "
            "above: the best round often lies well above it), so these ranks may say how fast a method learns "
            f"rather than where it ends. [`{CONVERGED_SUITE.as_posix()}`](../{CONVERGED_SUITE.as_posix()}) runs "
            "the same methods and settings at a budget where FedAvg's and the leading methods' last-10 means have "
            "settled (the convergence runs: [notes/convergence.md](notes/convergence.md)); its export fills this "
            "section.",
            "",
            *first_look(board, first),
        ]
    lines += [
        f"Gain over FedAvg at {board.rounds} and at {long.rounds} rounds (last-{board.last} mean, paired by seed, "
        f"{LEVEL:.0%} interval), and Spearman's rank correlation of the methods' last-{board.last} means "
        "between the two budgets (over the methods run at both).",
        "",
    ]
    for p in board.partitions:
        short, at_long = board.means(p), long.means(p)
        both = [m for m in short if m in at_long]
        if not both:
            continue
        a, b = [short[m] for m in both], [at_long[m] for m in both]
        rho = rank_correlation(a, b) if len(both) >= 3 else float("nan")
        lines += [
            f"**{md(p)}**: rank correlation {rho:.2f} over {len(both)} methods "
            f"({_seed_count(board, p)} and {_seed_count(long, p)} seeds).",
            "",
            f"| method | gain at {board.rounds} | gain at {long.rounds} |",
            "|---|---|---|",
        ]
        lines += [
            f"| {md(m)} | {_gain_cell(board.gain(p, m))} | {_gain_cell(long.gain(p, m))} |"
            for m in both
            if m != BASELINE
        ]
        lines.append("")
    return lines


@dataclass
class Look:
    """One setting of the convergence runs beside the short budget on the same seeds."""

    partition: str
    seeds: list[int]
    methods: list[str]  # run at both budgets, FedAvg first among them as the suites list it
    rounds: int  # the long runs' rounds
    rho: float  # Spearman's rank correlation of the methods' last-k means between the budgets
    flipped: list[str]  # above FedAvg at the short budget, below it at the long one (those seeds)

    @property
    def rho_text(self) -> str:
        return "n/a (fewer than 3 methods)" if math.isnan(self.rho) else f"{self.rho:.2f}"


def looks(board: Board, runs: Board | None) -> list[Look]:
    """Each setting of the convergence runs (`runs`) that also holds FedAvg at the short budget."""
    if runs is None or runs.results is None:
        return []
    out = []
    for p in runs.partitions:
        seeds, base = set(runs.seeds(p)), runs.cell(p, BASELINE)
        if not seeds or base is None:
            continue
        # a cell still at an earlier budget than FedAvg's is not compared
        same = [m for m in runs.methods if (c := runs.cell(p, m)) is not None and c.rounds == base.rounds]
        at_long = {m: v for m in same if (v := _on_seeds(runs, p, m, seeds))}
        short = {m: v for m in at_long if (v := _on_seeds(board, p, m, seeds))}
        methods = list(short)
        if BASELINE not in methods:
            continue
        a = [float(np.mean(list(short[m].values()))) for m in methods]
        b = [float(np.mean(list(at_long[m].values()))) for m in methods]
        rho = rank_correlation(a, b) if len(methods) >= 3 else float("nan")
        i = methods.index(BASELINE)
        flipped = [m for m, x, y in zip(methods, a, b, strict=True) if x > a[i] and y < b[i]]
        rounds = base.rounds or runs.rounds or 0
        out.append(Look(p, sorted(seeds), methods, rounds, rho, flipped))
    return out


def first_look(board: Board, runs: Board | None) -> list[str]:
    """The convergence runs' gains over FedAvg beside the same seeds' at the short budget, under the
    last-k mean and the best round, with the rank correlation of the methods' last-k means between
    the budgets: which verdicts the budget may move. Their seeds are few (no interval at one seed)."""
    lines: list[str] = []
    for look in looks(board, runs):
        p, seeds = look.partition, set(look.seeds)
        lines += [
            f"**{md(p)}**, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, look.seeds))}: the rank "
            f"correlation of the last-{board.last} means between {board.rounds} and {look.rounds} rounds is "
            f"{look.rho_text} over {len(look.methods)} methods.",
            "",
            f"| method | last {board.last}, {board.rounds} rounds | {look.rounds} rounds | best round, "
            f"{board.rounds} rounds | {look.rounds} rounds |",
            "|---|---|---|---|---|",
        ]
        for m in look.methods:
            if m != BASELINE:
                gains = [_seed_gain(b, p, m, seeds, stat) for stat in ("", "global.best") for b in (board, runs)]
                lines.append(f"| {md(m)} | " + " | ".join(gains) + " |")
        lines.append("")
    if not lines:
        return []
    return [
        f"**A first look** from the convergence runs ([`{CONVERGED_RUNS.as_posix()}`](../{CONVERGED_RUNS.as_posix()}), "
        "their result file): the gain over FedAvg of the leading methods at a long budget beside the same seeds' "
        "at this one. Too few seeds for an interval (one seed: its gain alone): these rows say which verdicts "
        "the budget may move, not that it does.",
        "",
        *lines,
    ]


def looks_sentence(board: Board, runs: Board | None) -> str:
    """README's line under the headline: what the first look at a long budget says ('' before it)."""
    found = looks(board, runs)
    if not found:
        return ""
    parts = []
    for look in found:
        part = f"{md(look.partition)} {look.rho_text} at {look.rounds} rounds"
        if look.flipped:
            part += f" ({', '.join(map(md, look.flipped))} there below FedAvg)"
        parts.append(part)
    seeds = sorted({s for look in found for s in look.seeds})
    return (
        f"**These are gains at {board.rounds} rounds.** A first look at a long budget (the convergence runs, seed"
        f"{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, the leading methods) gives the rank "
        f"correlation of their last-{board.last} means with this budget's: {'; '.join(parts)}. "
        '[docs/leaderboard.md](docs/leaderboard.md), "Budget", until the converged leaderboard has run.'
    )


def _on_seeds(board: Board, partition: str, method: str, seeds: set[int], stat: str = "") -> dict[int, float]:
    return {s: v for s, v in (board.values(partition, method, stat) or {}).items() if s in seeds}


def _seed_gain(board: Board, partition: str, method: str, seeds: set[int], stat: str) -> str:
    """The gain over FedAvg on `seeds`: `_gain_cell`, or the signed gain alone at one seed."""
    iv = paired_gain(
        _on_seeds(board, partition, method, seeds, stat), _on_seeds(board, partition, BASELINE, seeds, stat)
    )
    if iv is None or iv.n >= 2:
        return _gain_cell(iv)
    return f"{iv.mean:+.1f}"


def where_ran(board: Board) -> str:
    """'Where the cells ran and how long ...: c2 cpu, 11.2 h over the 80 of 100 runs timed; dir01
    cpu, cuda.' from the cells' devices and their runs' wall times ('' when none is recorded)."""
    parts = []
    for p in board.partitions:
        devices, walls, runs = recorded_time([c for m in board.methods if (c := board.cell(p, m))])
        took = f"{sum(walls) / 3600:.1f} h"
        if len(walls) < runs:
            took += f" over the {len(walls)} of {runs} runs timed"
        if devices or walls:
            where = ", ".join(map(md, devices)) or "device not recorded"
            parts.append(", ".join([f"{md(p)} {where}", *([took] if walls else [])]))
    if not parts:
        return ""
    return (
        "Where the cells ran and how long (the wall time of their runs, summed; the queue runs two at once), "
        f"as their result file records: {'; '.join(parts)}."
    )


# a method whose global model is FedAvg's by design (the same local training and averaging; Ditto adds
# a personalized model beside it): on one seed and one processor their global accuracies are equal
TWIN_OF_FEDAVG = "ditto"


def processors_line(board: Board) -> str:
    """Which processors ran each setting's runs (float32 sums differ between them, so a seed's cells
    are paired to the last digit only on one), the seeds whose recorded runs span several, and where
    FedAvg's twin (`TWIN_OF_FEDAVG`) parts from FedAvg: the rounding a pair of cells can carry."""
    parts, mixed, twins = [], [], []
    for p in board.partitions:
        cells = [c for m in board.methods if (c := board.cell(p, m))]
        runs = sum(len(c.seeds) for c in cells)
        counts: dict[str, int] = {}
        by_seed: dict[int, set[str]] = {}
        for c in cells:
            for seed, name in c.processor.items():
                counts[name] = counts.get(name, 0) + 1
                by_seed.setdefault(seed, set()).add(name)
        if counts:
            named = [f"{md(n)} {k} run{'s' * (k != 1)}" for n, k in sorted(counts.items())]
            parts.append(f"{md(p)}: {', '.join(named)}, {runs - sum(counts.values())} not recorded")
        mixed += [f"{md(p)} seed {s}" for s, names in sorted(by_seed.items()) if len(names) > 1]
        fedavg, twin = board.values(p, BASELINE), board.values(p, TWIN_OF_FEDAVG)
        base, other = board.cell(p, BASELINE), board.cell(p, TWIN_OF_FEDAVG)
        for s in sorted(set(fedavg or {}) & set(twin or {})):
            if twin[s] != fedavg[s]:
                ran = {c.processor.get(s) for c in (base, other) if c is not None}
                why = "processors not recorded" if None in ran else ("one processor" if len(ran) == 1 else "two")
                twins.append(f"{md(p)} seed {s} ({twin[s] - fedavg[s]:+.2f}, {why})")
    if not parts and not twins:
        return ""
    text = "Processors, as the runs record them (float32 sums differ between processors, so a seed's cells are "
    text += "paired to the last digit only where one processor ran them): "
    if parts:
        text += f"{'; '.join(parts)}. Seeds whose recorded runs span processors: {', '.join(mixed) or 'none'}."
    else:
        text += "none of these runs records one."
    if twins:
        text += (
            f" The global model of {TWIN_OF_FEDAVG} is FedAvg's by design, and on one processor their values are "
            f"equal; they differ on {', '.join(twins)}. Between two processors that is the float32 rounding "
            f"{board.rounds} rounds amplify, noise inside each interval, not a bias "
            "([notes/pairing.md](notes/pairing.md)); on one processor it would be a defect."
        )
    return text


def clipped_line(board: Board) -> str:
    """How often `update-norm-bound` clipped an honest update, per setting, over the runs whose count
    the result file records ('' when none does): the numbers hold under that default."""
    parts = []
    for p in board.partitions:
        cells = [c for m in board.methods if (c := board.cell(p, m))]
        counts = [n for c in cells for n in c.clipped.values()]
        if counts:
            hit = [c.method for c in cells if any(c.clipped.values())]
            parts.append(
                f"{md(p)}: {sum(1 for n in counts if n)} of {len(counts)} runs, {sum(counts)} updates "
                f"({', '.join(map(md, hit)) or 'none'})"
            )
    if not parts:
        return ""
    bound = all_params()["update-norm-bound"].default
    return (
        f"Honest updates `update-norm-bound` clipped (each update to {bound:g} times its round's median norm, a "
        "default), over the runs whose count the result file records (the others ran before the bound existed or "
        "were exported before counts were kept): "
        + "; ".join(parts)
        + ". The gains are those of fedskew's defaults, the bound included (its effect on clipped runs: "
        "[notes/update-ratio.md](notes/update-ratio.md))."
    )


def stopped_line(board: Board) -> str:
    """The runs that stopped at a round no retry completed ('' when none did): their statistics are
    over the rounds before, so a diverged run counts rather than being left out."""
    parts = [
        f"{md(p)}/{md(m)}: {text}"
        for p in board.partitions
        for m in board.methods
        if (c := board.cell(p, m)) and (text := stopped_text(c))
    ]
    if not parts:
        return ""
    return (
        "Runs that stopped at a round no retry completed (every reply refused or lost), counted with the "
        "statistics of the rounds before it: " + "; ".join(parts) + "."
    )


def leaderboard_md(
    suite_path: Path, board: Board, root: Path = Path("."), long: Board | None = None, first: Board | None = None
) -> str:
    last, partitions = board.last, board.partitions
    header = [line[2:] if line.startswith("# ") else line[1:] for line in _header_comment(root / suite_path)]
    lines = ["# Leaderboard: every method on three label-skew settings", "", GENERATED, ""]
    lines += [
        f"The suite [`{suite_path.as_posix()}`](../{suite_path.as_posix()}) runs every registered method on "
        f"the same settings, seeds and budget ({board.rounds} rounds; its protocol: below). Every method of a "
        "seed sees the same partition and the same sampled clients, so gains are **paired by seed**: the "
        f"mean gain over FedAvg with its {LEVEL:.0%} Student-t interval over the seeds (`fedskew/reports/stats.py`). "
        "A method beats FedAvg only where that interval excludes 0 (bold).",
        "",
    ]
    if board.results is None or not board.results.cells:
        lines += [
            "**Not run yet.** The tables fill from `results/leaderboard.yaml`, which "
            f"`fedskew experiment {suite_path.as_posix()} --export` writes after the suite has run "
            "(`fedskew report` then regenerates this page).",
            "",
        ]
    if verdict := leaderboard_verdict(board):
        lines += [verdict, ""]
    if ran := where_ran(board):
        lines += [ran, ""]
    if chips := processors_line(board):
        lines += [chips, ""]
    if clipped := clipped_line(board):
        lines += [clipped, ""]
    if stopped := stopped_line(board):
        lines += [stopped, ""]
    lines += [
        f"## Gain in global accuracy over FedAvg (points, mean of the last {last} rounds, paired by seed)",
        "",
        f"Each setting: the gain with its {LEVEL:.0%} interval, and the chance of ranking in the top {TOP} when "
        "the seeds are drawn again (a bootstrap over whole seeds, every method's value of a seed together). "
        + holm_sentence(board),
        "",
        "| method | " + " | ".join(f"{md(p)} ({_seed_count(board, p)} seeds) | top {TOP}" for p in partitions) + " |",
        "|---|" + "---|---|" * len(partitions),
    ]
    chances = {p: board.top_chance(p) for p in partitions}
    kept = {p: board.holm_kept(p) for p in partitions}
    for m in board.methods:
        cells = []
        for p in partitions:
            if m == BASELINE:
                cells.append(f"{_lb_value(board.cell(p, m), 'global', last)} (baseline)")
            else:
                cells.append(_board_gain_cell(board, p, m, kept[p]))
            cells.append(f"{chances[p][m]:.0%}" if m in chances[p] else "-")
        lines.append(f"| {md(m)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![gain over FedAvg, methods x settings](img/leaderboard-gain.png)",
        "",
        *seeds_section(board),
        f"## The last {last} rounds against the best round",
        "",
        f"The statistic above is the mean of the last {last} rounds (what a run ends with); the best round is "
        "what papers often report. Global accuracy, %, mean ± std over the seeds, and the gain over FedAvg "
        "under each statistic.",
        "",
        f"| method | setting | last {last} | gain | best round | gain |",
        "|---|---|---|---|---|---|",
    ]
    for m, p, cell in leaderboard_rows(board):
        if cell is None or f"global.last{last}" not in cell.stats:
            continue
        best = cell.stats.get("global.best")
        lines.append(
            f"| {md(m)} | {md(p)} | {_lb_value(cell, 'global', last)} | {_gain_cell(board.gain(p, m))} | "
            f"{fmt_value(best) if best else 'n/a'} | {_gain_cell(board.gain(p, m, 'global.best'))} |"
        )
    lines += [
        "",
        *budget_section(board, long, first),
        "## Protocol, as the suite's header gives it",
        "",
        *md_code_block(header),
        "",
        "## Balanced, worst-class and personalized accuracy",
        "",
        f"Balanced: the global model's mean per-class accuracy; worst class: its worst class's accuracy in each "
        f"round; personalized: each method's personalized model on its clients' local test splits (FedAvg's: "
        f"its locally trained model, FedAvg-FT). All means of the last {last} rounds, %, mean ± std over the "
        "seeds; n/a: not measured by the runs (balanced and worst-class accuracy come with the per-class "
        "diagnostics).",
        "",
        "| method | setting | seeds | global | balanced | worst class | personalized |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, p, cell in leaderboard_rows(board):
        values = " | ".join(_lb_value(cell, metric, last) for metric in LEADERBOARD_STATS)
        lines.append(f"| {md(m)} | {md(p)} | {len(cell.seeds) if cell else 0} | {values} |")
    return "\n".join(lines) + "\n"


def leaderboard_rows(board: Board) -> list[tuple[str, str, CellResult | None]]:
    """(method label, partition label, cell or None) for every method x setting of the suite."""
    return [(m, p, board.cell(p, m)) for m in board.methods for p in board.partitions]


def leaderboard_headline(board: Board, runs: Board | None = None) -> list[str]:
    """README's table: each method's paired gain over FedAvg per setting, with its interval; under it
    the verdict and, from the convergence runs `runs`, what a long budget may move (`looks_sentence`)."""
    if board.results is None or not board.results.cells:
        return [
            "The leaderboard ([docs/leaderboard.md](docs/leaderboard.md): every method on Dirichlet 0.1, 2 classes "
            "per client and a long tail) has not run yet; its suite is `suites/leaderboard.yaml`."
        ]
    seeds = ", ".join(f"{md(p)} {_seed_count(board, p)}" for p in board.partitions)
    lines = [
        f"Gain in global accuracy over FedAvg (points, mean of the last {board.last} of {board.rounds} rounds), "
        f"paired by seed, with its {LEVEL:.0%} interval (seeds: {seeds}; **bold**: the interval excludes 0; "
        f"{HOLM_MARK}: it still does under Holm's correction over the setting's methods). "
        "[docs/leaderboard.md](docs/leaderboard.md) has the ranks' chances, the best round, balanced, "
        "worst-class and personalized accuracy.",
        "",
        "| method | " + " | ".join(map(md, board.partitions)) + " | personalized, mean of the settings |",
        "|---|" + "---|" * (len(board.partitions) + 1),
    ]
    key = f"personalized.last{board.last}"
    kept = {p: board.holm_kept(p) for p in board.partitions}
    for m in board.methods:
        if m == BASELINE:
            cells = [_lb_value(board.cell(p, m), "global", board.last).split(" ±")[0] for p in board.partitions]
        else:
            cells = [_board_gain_cell(board, p, m, kept[p]) for p in board.partitions]
        own = [c.stats[key].mean for p in board.partitions if (c := board.cell(p, m)) and key in c.stats]
        own_text = f"{np.mean(own):.2f}" if own and len(own) == len(board.partitions) else "n/a"
        lines.append(f"| {md(m)} | " + " | ".join(cells) + f" | {own_text} |")
    said = looks_sentence(board, runs)
    return [*lines, "", leaderboard_verdict(board), *(["", said] if said else [])]


def leaderboard_figure(board: Board, path: Path) -> None:
    """Methods x settings heatmap of the paired gain over FedAvg; a dot marks an interval that
    excludes 0, `HOLM_MARK` one that also holds under Holm's correction (grey: not run)."""
    import matplotlib
    from matplotlib.figure import Figure

    methods, partitions = [m for m in board.methods if m != BASELINE], board.partitions
    gains = {(m, p): board.gain(p, m) for m in methods for p in partitions}
    grid = np.array([[g.mean if (g := gains[(m, p)]) else np.nan for p in partitions] for m in methods])
    fig = Figure(figsize=(2.6 + 1.9 * len(partitions), 1.2 + 0.32 * len(methods)), layout="constrained")
    ax = fig.subplots()
    bound = max(1.0, float(np.nanmax(np.abs(grid)))) if np.isfinite(grid).any() else 1.0
    image = ax.imshow(
        np.ma.masked_invalid(grid),
        cmap=matplotlib.colormaps["RdBu"].with_extremes(bad="lightgrey"),
        vmin=-bound,
        vmax=bound,
        aspect="auto",
    )
    kept = {p: board.holm_kept(p) for p in partitions}
    for i, j in zip(*np.where(np.isfinite(grid)), strict=True):
        g = gains[(methods[i], partitions[j])]
        dark = abs(grid[i, j]) > 0.6 * bound  # white on the deep colours
        mark = "•" if g is not None and g.excludes_zero() else ""
        half = f" ±{g.half:.1f}" if g is not None and g.n >= 2 else ""
        holm_mark = HOLM_MARK if mark and methods[i] in kept[partitions[j]] else ""
        text = f"{mark}{grid[i, j]:+.1f}{half}{holm_mark}"
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    for i, j in zip(*np.where(~np.isfinite(grid)), strict=True):
        if board.no_global(partitions[j], methods[i]):
            ax.text(j, i, NO_GLOBAL, ha="center", va="center", fontsize=7, color="dimgrey")
    ax.set_xticks(range(len(partitions)), [f"{p} ({len(board.seeds(p))} seeds)" for p in partitions])
    ax.set_yticks(range(len(methods)), methods)
    ax.set_title(
        f"global accuracy gain over FedAvg (points, last-{board.last} mean, paired; "
        f"± half the {LEVEL:.0%} interval; • excludes 0; {HOLM_MARK} also under Holm's correction)",
        fontsize=8,
    )
    fig.colorbar(image, ax=ax)
    save_figure(fig, path)


def _header_comment(path: Path) -> list[str]:
    """The suite file's leading comment lines (its protocol and the wall-time estimate)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line)
    return out
