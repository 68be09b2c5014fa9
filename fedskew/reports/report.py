"""The reports, generated from the committed result files: `fedskew report` (`python -m fedskew.reports.report`).

Inputs (committed): `results/*.yaml` (the cells' numbers, `fedskew.reports.resultfile`) and the hand-written
claims file `results/claims.yaml`. Outputs:

- `docs/results.md`: a summary table of every claim (the paper's gain, ours with the seeds'
  spread, the verdict) and `docs/img/claims.png` (each claim's paper gain against ours), then one
  section per paper, its rows one by one (the paper's number, ours, the verdict and its reason);
- `docs/leaderboard.md` and `docs/img/leaderboard-gain.png` from `results/leaderboard.yaml` and the
  suite `suites/leaderboard.yaml` (every method on the standard label-skew settings;
  `fedskew.reports.leaderboard`);
- README.md's generated blocks, between `<!-- report:<name> begin -->` and `<!-- report:<name> end -->`;
- `docs/notes/peers.md`'s block `peers`: the peers' published numbers beside ours (`fedskew.reports.peers`).

`--check` writes nothing and exits 1 naming each text file that differs from what the committed
data give (the figures are redrawn by a plain `fedskew report`).

The claims file, per paper::

    papers:
    - key: fedrs
      title: FedRS (Li & Zhan, KDD 2021)
      claim: what the paper claims, in one line
      notes: notes/fedrs.md                 # the long form (diagnostics, narratives), under docs/
      tables:
      - title: Table 1 protocol, 300 of the paper's 1000 rounds
        setting: one line (what ran, what was shrunk, whose numbers the paper column holds)
        stat: global.last50                 # the rows' statistic (a row may give its own)
        rows:
        - row: C10-100-2 FedRS (alpha 0.5)
          paper: 70.8                       # the paper's number (null where it has none); paper-note: text
          ours: paper-fedrs/c10-100-2/fedrs-0.5       # <result file>/<partition>/<method>
          vs: {paper: 55.9, ours: paper-fedrs/c10-100-2/fedavg}   # the baseline of a gain (stat: optional)
          verdict: holds                    # holds, direction holds, fails, or - for a reference row
          reason: one line; {A}, {A - B}, {A / B} with A, B references (`ref:stat` for another
                  statistic) or `gain`, `ours`, `base` give numbers from the result files
          claim: the claim in the summary table (rows without one stay in their section)
          headline: true                    # also in README's headline table
          level: true                       # the claim is "level with" (no difference): judged by
                                            #   equivalence within LEVEL_MARGIN points

A gain is `ours - vs` in points of the row's statistic, paired by seed: its mean with the 95 %
Student-t interval over the seeds both cells hold (`fedskew.reports.stats`), where both kept their per-seed
values; else Welch's unpaired interval from the cells' means and stds, marked "unpaired". The written verdict is
re-judged against that interval (`judged_verdict`): "holds" needs an interval on the paper's side of
0, "direction holds" a mean on its side and no interval on the other, a "fails" whose interval lies
on the paper's side becomes "direction holds"; a `level` claim holds when its whole interval lies
within +-`LEVEL_MARGIN` points and fails when it lies beyond. A verdict that changes is shown with
the written one.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedskew.config import ConfigError
from fedskew.files import locked, write_text
from fedskew.reports.leaderboard import (
    CONVERGED_RUNS,
    CONVERGED_SUITE,
    LEADERBOARD_SUITE,
    Board,
    leaderboard_figure,
    leaderboard_headline,
    leaderboard_md,
)
from fedskew.reports.markdown import md, md_link
from fedskew.reports.pages import GENERATED, fmt_value, save_figure
from fedskew.reports.peers import BLOCK as PEERS_BLOCK
from fedskew.reports.peers import peers_block
from fedskew.reports.resultfile import STAT_NAME, CellResult, ResultSet, Stat, describe_stat, load_all, per_seed_values
from fedskew.reports.stats import LEVEL, Interval, paired_gain, welch_interval

VERDICTS = ("holds", "direction holds", "fails", "-")
LEVEL_MARGIN = 1.0  # points: a "level" claim holds when its whole interval lies within +- this
COLOURS = {"holds": "tab:green", "direction holds": "tab:orange", "fails": "tab:red"}
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


# ---------------------------------------------------------------------------------------------- claims


@dataclass
class Row:
    label: str
    ours: str
    stat: str
    paper: float | None = None
    paper_text: str = ""  # the paper's number as the claims file writes it
    paper_note: str = ""
    vs: str = ""
    vs_paper: float | None = None
    vs_stat: str = ""
    verdict: str = "-"
    reason: str = ""
    claim: str = ""
    headline: bool = False
    level: bool = False


@dataclass
class Table:
    title: str
    setting: str
    stat: str
    rows: list[Row]


@dataclass
class Paper:
    key: str
    title: str
    claim: str
    notes: str
    tables: list[Table]


@dataclass
class Claims:
    intro: str
    not_covered: str
    papers: list[Paper] = field(default_factory=list)


def _get(raw: dict, key: str, kind: type, where: str, default: Any = None) -> Any:
    value = raw.get(key, default)
    if value is None and default is None and kind is not type(None):
        raise ConfigError(f"{where}: no {key}")
    if kind is float:
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{where}: {key}={value!r} is not allowed: must be a {kind.__name__}")
    return float(value) if kind is float and value is not None else value


def _paper_number(value: Any, where: str) -> float | None:
    """A paper's number: null, a number, or a string holding one ("91.90", kept as the paper prints it)."""
    if value is None:
        return None
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(f"{where}={value!r} is not allowed: must be a number (or null)")
    return number


def _row(raw: Any, where: str, default_stat: str) -> Row:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    allowed = {"row", "paper", "paper-note", "ours", "stat", "vs", "verdict", "reason", "claim", "headline", "level"}
    if unknown := sorted(set(raw) - allowed):
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    vs = raw.get("vs") or {}
    if not isinstance(vs, dict) or set(vs) - {"paper", "ours", "stat"}:
        raise ConfigError(f"{where}: vs={vs!r} is not allowed: must be a mapping of paper, ours and stat")
    stat = _get(raw, "stat", str, where, default_stat)
    if not STAT_NAME.match(stat):
        raise ConfigError(f"{where}: stat={stat!r} is not a statistic name (e.g. global.last10)")
    verdict = _get(raw, "verdict", str, where, "-")
    if verdict not in VERDICTS:
        raise ConfigError(f"{where}: verdict={verdict!r} is not allowed: must be one of {', '.join(VERDICTS)}")
    row = Row(
        label=_get(raw, "row", str, where),
        ours=_get(raw, "ours", str, where),
        stat=stat,
        paper=_paper_number(raw.get("paper"), f"{where}: paper"),
        paper_text=str(raw["paper"]) if raw.get("paper") is not None else "",
        paper_note=_get(raw, "paper-note", str, where, ""),
        vs=_get(vs, "ours", str, f"{where}.vs", "") if vs else "",
        vs_paper=_paper_number(vs.get("paper"), f"{where}.vs: paper"),
        vs_stat=_get(vs, "stat", str, f"{where}.vs", "") if vs else "",
        verdict=verdict,
        reason=_get(raw, "reason", str, where, ""),
        claim=_get(raw, "claim", str, where, ""),
        headline=_get(raw, "headline", bool, where, False),
        level=_get(raw, "level", bool, where, False),
    )
    if vs and not row.vs:
        raise ConfigError(f"{where}.vs: no ours (the baseline cell)")
    if row.claim and not row.vs:
        raise ConfigError(f"{where}: a claim needs vs (the baseline its gain is measured against)")
    return row


def load_claims(path: str | Path) -> Claims:
    """Read and check the claims file (ConfigError naming the file and the place otherwise)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("papers"), list):
        raise ConfigError(f"{path}: must be a mapping with a list under papers")
    claims = Claims(_get(raw, "intro", str, str(path), ""), _get(raw, "not-covered", str, str(path), ""))
    for i, p in enumerate(raw["papers"]):
        where = f"{path}: papers[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("tables"), list):
            raise ConfigError(f"{where}: must be a mapping with a list under tables")
        tables = []
        for j, t in enumerate(p["tables"]):
            tw = f"{where}.tables[{j}]"
            if not isinstance(t, dict) or not isinstance(t.get("rows"), list):
                raise ConfigError(f"{tw}: must be a mapping with a list under rows")
            stat = _get(t, "stat", str, tw, "global.last10")
            rows = [_row(r, f"{tw}.rows[{k}]", stat) for k, r in enumerate(t["rows"])]
            tables.append(Table(_get(t, "title", str, tw), _get(t, "setting", str, tw, ""), stat, rows))
        claims.papers.append(
            Paper(
                _get(p, "key", str, where),
                _get(p, "title", str, where),
                _get(p, "claim", str, where, ""),
                _get(p, "notes", str, where, ""),
                tables,
            )
        )
    return claims


# ---------------------------------------------------------------------------------------------- numbers


class Evidence:
    """The result files, looked up by reference `<file>/<partition>/<method>`."""

    def __init__(self, sets: dict[str, ResultSet]) -> None:
        self.sets = sets

    def cell(self, ref: str) -> CellResult:
        file, _, rest = ref.partition("/")
        partition, _, method = rest.partition("/")
        found = self.sets[file].cell(partition, method) if file in self.sets else None
        if found is None:
            raise ConfigError(f"no result cell {ref!r} (results/<file>.yaml, partition, method)")
        return found

    def stat(self, ref: str, stat: str) -> Stat:
        cell = self.cell(ref)
        if stat not in cell.stats:
            raise ConfigError(f"result cell {ref!r} has no statistic {stat!r} (it has: {', '.join(cell.stats)})")
        return cell.stats[stat]


@dataclass
class Numbers:
    """What a row shows: our statistic, its baseline's, the gains and the spread of ours."""

    ours: Stat
    base: Stat | None
    gain: float | None
    interval: Interval | None  # paired by seed, or Welch's where per-seed values were not kept
    paired: bool
    paper_gain: float | None

    @property
    def spread(self) -> float | None:
        """Half the interval's width: the figure's error bar."""
        return self.interval.half if self.interval is not None and self.interval.n >= 2 else None

    def gain_text(self) -> str:
        if self.interval is None:
            return fmt_gain(self.gain)
        return self.interval.text() + ("" if self.paired else " (unpaired)")


def numbers(row: Row, ev: Evidence) -> Numbers:
    ours = ev.stat(row.ours, row.stat)
    if not row.vs:
        return Numbers(ours, None, None, None, False, None)
    vs_stat = row.vs_stat or row.stat
    base = ev.stat(row.vs, vs_stat)
    a, b = per_seed_values(ev.cell(row.ours), row.stat), per_seed_values(ev.cell(row.vs), vs_stat)
    interval = paired_gain(a, b) if a is not None and b is not None else None
    paired = interval is not None
    if interval is None and ours.std is not None and base.std is not None:
        n_a, n_b = len(ev.cell(row.ours).stat_seeds(row.stat)), len(ev.cell(row.vs).stat_seeds(vs_stat))
        interval = welch_interval((ours.mean, ours.std, n_a), (base.mean, base.std, n_b))
    paper_gain = row.paper - row.vs_paper if row.paper is not None and row.vs_paper is not None else None
    gain = interval.mean if interval is not None else ours.mean - base.mean
    return Numbers(ours, base, gain, interval, paired, paper_gain)


def unpaired_claim_cells(claims: Claims, ev: Evidence) -> dict[str, list[str]]:
    """Result file -> the 'partition/method' cells whose runs would pair a claim's gain that is not
    paired today (a side recorded without per-seed values, or the two sides sharing under 2 seeds):
    what a re-run needs for the claims' paired intervals, in the claims file's order."""
    out: dict[str, list[str]] = {}
    for row in (r for p in claims.papers for t in p.tables for r in t.rows if r.claim and r.vs):
        nums = numbers(row, ev)
        if nums.paired and nums.interval is not None and nums.interval.n >= 2:
            continue
        for ref in (row.ours, row.vs):
            file, _, cell = ref.partition("/")
            if cell not in out.setdefault(file, []):
                out[file].append(cell)
    return out


def fmt_gain(g: float | None, spread: float | None = None) -> str:
    if g is None:
        return "n/a"
    digits = 1 if abs(g) >= 1 or (spread is not None and spread >= 1) else 2
    text = f"{g:+.{digits}f}"
    return text if spread is None else f"{text} ± {spread:.{digits}f}"


def judged_verdict(row: Row, nums: Numbers) -> str:
    """The written verdict re-judged against the paired interval (module docstring); unchanged where
    there is no interval (fewer than 2 shared seeds), or neither a paper gain nor a claim to take a
    side from (a claim without the paper's number is a "beats": the side above 0)."""
    written = row.verdict
    iv, paper = nums.interval, nums.paper_gain
    if written == "-" or iv is None or iv.n < 2:
        return written
    if row.level:  # equivalence: the whole interval within the margin, or beyond it on one side
        if -LEVEL_MARGIN <= iv.low and iv.high <= LEVEL_MARGIN:
            return "holds"
        if iv.low > LEVEL_MARGIN or iv.high < -LEVEL_MARGIN:
            return "fails"
        return written  # too wide to tell at these seeds
    if not paper and not row.claim:
        return written
    side = -1 if paper and paper < 0 else 1  # a claim without the paper's number says "beats": above 0
    if written == "holds" and iv.sign() != side:
        return "direction holds" if side * iv.mean > 0 else "fails"
    if written == "direction holds" and (iv.sign() == -side or side * iv.mean <= 0):
        return "fails"
    if written == "fails" and iv.sign() == side:
        return "direction holds"
    return written


def _operand(token: str, row: Row, nums: Numbers, ev: Evidence) -> float:
    token = token.strip()
    special = {"gain": nums.gain, "ours": nums.ours.mean, "base": nums.base.mean if nums.base else None}
    if token in special:
        if special[token] is None:
            raise ConfigError(f"row {row.label!r}: {{{token}}} needs a baseline (vs)")
        return float(special[token])
    ref, _, stat = token.partition(":")
    return ev.stat(ref, stat or row.stat).mean


def render_reason(row: Row, nums: Numbers, ev: Evidence) -> str:
    """The reason with each {placeholder} replaced by its number from the result files: {A} a value
    (2 decimals), {A - B} a signed difference, {A / B} a ratio (1 decimal)."""

    def one(match: re.Match[str]) -> str:
        text = match[1]
        for op in (" - ", " / "):
            if op in text:
                left, right = (_operand(t, row, nums, ev) for t in text.split(op, 1))
                return fmt_gain(left - right) if op == " - " else f"{left / right:.1f}"
        value = _operand(text, row, nums, ev)
        return fmt_gain(value) if text.strip() == "gain" else f"{value:.2f}"

    return PLACEHOLDER.sub(one, row.reason)


def shown_verdict(row: Row, nums: Numbers) -> str:
    """The re-judged verdict (`judged_verdict`), with the written one where they differ."""
    judged = judged_verdict(row, nums)
    if judged == "-":
        return "-"
    if judged != row.verdict:
        iv = nums.interval
        if row.level:
            where = f"{'lies within' if judged == 'holds' else 'reaches beyond'} +-{LEVEL_MARGIN:g} point"
        else:
            where = "includes 0" if iv is not None and not iv.excludes_zero() else "lies on one side of 0"
        return f"**{judged}** (written: {row.verdict}; the {LEVEL:.0%} interval {where})"
    return f"**{judged}**"


# ---------------------------------------------------------------------------------------------- results.md


@dataclass
class ClaimPoint:
    number: int
    paper: str
    claim: str
    stat: str
    verdict: str
    paper_gain: float | None
    gain: float
    spread: float | None
    headline: bool
    gain_text: str = ""
    seeds: int = 0  # that the gain's interval is over (0: no interval)


def claim_points(claims: Claims, ev: Evidence) -> list[ClaimPoint]:
    """Every row with a claim, numbered in order: the summary table's and the figure's points."""
    points = []
    for paper in claims.papers:
        for table in paper.tables:
            for row in table.rows:
                if row.claim:
                    nums = numbers(row, ev)
                    assert nums.gain is not None
                    points.append(
                        ClaimPoint(
                            len(points) + 1,
                            paper.title,
                            row.claim,
                            row.stat,
                            shown_verdict(row, nums),
                            nums.paper_gain,
                            nums.gain,
                            nums.spread,
                            row.headline,
                            nums.gain_text(),
                            nums.interval.n if nums.interval is not None else 0,
                        )
                    )
    return points


def summary_table(points: list[ClaimPoint], numbered: bool = True) -> list[str]:
    gain = f"our gain [{LEVEL:.0%} interval]"
    head = f"| # | paper | claim | paper's gain | {gain} | verdict |" if numbered else None
    lines = [head or f"| paper | claim | paper's gain | {gain} | verdict |"]
    lines.append("|---|---|---|---|---|---|" if numbered else "|---|---|---|---|---|")
    for p in points:
        cells = [md(p.paper.split(" (")[0]), md(p.claim), fmt_gain(p.paper_gain), p.gain_text, p.verdict]
        lines.append("| " + " | ".join(([str(p.number)] if numbered else []) + cells) + " |")
    return lines


def paper_section(paper: Paper, ev: Evidence) -> list[str]:
    lines = [f"## {md(paper.title)}", ""]
    if paper.claim:
        lines.append(f"*Claim:* {md(paper.claim)}. Long form: {md_link(paper.notes, paper.notes)}.")
    for table in paper.tables:
        lines += ["", f"**{md(table.title)}.** {md(table.setting)} Statistic: {describe_stat(table.stat)}.", ""]
        lines += ["| row | paper | ours | verdict | reason |", "|---|---|---|---|---|"]
        for row in table.rows:
            nums = numbers(row, ev)
            paper = md(row.paper_text) or "-"
            if nums.paper_gain is not None:
                paper += f" ({fmt_gain(nums.paper_gain)})"
            if row.paper_note:
                paper = md(row.paper_note) if row.paper is None else f"{paper}, {md(row.paper_note)}"
            ours = fmt_value(nums.ours)
            if nums.gain is not None:
                ours += f" ({nums.gain_text()})"
            stat = "" if row.stat == table.stat else f" *({short_stat(row.stat)})*"
            reason = md(render_reason(row, nums, ev))
            lines.append(f"| {md(row.label)}{stat} | {paper} | {ours} | {shown_verdict(row, nums)} | {reason} |")
    return [*lines, ""]


def short_stat(name: str) -> str:
    """'personalized.last10' -> 'personalized, last 10' (a row whose statistic is not its table's)."""
    metric, stat = name.split(".", 1)
    words = re.sub(r"^last(\d+)$", r"last \1", stat)
    words = re.sub(r"^osc(\d+)$", r"oscillation over the last \1", words)
    words = re.sub(r"^osc(\d+)-(\d+)$", r"oscillation over rounds \1-\2", words)
    words = re.sub(r"^r(\d+)-(\d+)$", r"rounds \1-\2", words)
    return f"{metric}, {words}"


def results_md(claims: Claims, ev: Evidence) -> str:
    points = claim_points(claims, ev)
    drawn = [p for p in points if p.paper_gain is not None]
    undrawn = ", ".join(str(p.number) for p in points if p.paper_gain is None)
    lines = ["# Reproduction report", "", GENERATED, "", md(claims.intro.strip(), cell=False), ""]
    lines += ["## Every claim at a glance", ""]
    lines += summary_table(points)
    lines += [
        "",
        "![each claim's gain in the paper against ours](img/claims.png)",
        "",
        f"*Each claim's gain in its paper (x) against ours (y), with its {LEVEL:.0%} interval; {len(drawn)} of "
        f"the {len(points)} claims (those with a number in the paper; not drawn: {undrawn or 'none'}). On the "
        "diagonal we measure the paper's gain; above zero, the direction.*",
        "",
    ]
    for paper in claims.papers:
        lines += paper_section(paper, ev)
    if claims.not_covered:
        lines += ["## What this report does not cover", "", md(claims.not_covered.strip(), cell=False), ""]
    return "\n".join(lines)


def claims_figure(points: list[ClaimPoint], path: Path) -> None:
    """Each claim with a paper number: the paper's gain against ours with its spread, by verdict."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 6.0), layout="constrained")
    ax = fig.subplots()
    drawn = [p for p in points if p.paper_gain is not None and not p.stat.split(".")[1].startswith("osc")]
    for verdict, colour in COLOURS.items():
        group = [p for p in drawn if p.verdict.strip("*").split("*")[0] == verdict]
        if group:
            ax.errorbar(
                [p.paper_gain for p in group],
                [p.gain for p in group],
                yerr=[p.spread or 0.0 for p in group],
                fmt="o",
                color=colour,
                label=verdict,
                capsize=3,
            )
    for p in drawn:
        ax.annotate(str(p.number), (p.paper_gain, p.gain), textcoords="offset points", xytext=(4, 3), fontsize=7)
    x_lo = min([0.0, *(p.paper_gain for p in drawn)]) - 1
    x_hi = max([1.0, *(p.paper_gain for p in drawn)]) + 1
    ax.plot([x_lo, x_hi], [x_lo, x_hi], "--", color="grey", linewidth=0.8, label="ours = paper's")
    ax.set_xlim(x_lo, x_hi)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("the paper's gain (points)")
    ax.set_ylabel(f"our gain (points), {LEVEL:.0%} interval over seeds")
    ax.set_title("Each claim (numbers: the summary table's #)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- README blocks


def replace_block(text: str, name: str, body: list[str], file: str = "README.md") -> str:
    """`text` (of `file`) with the lines between `<!-- report:<name> begin -->` and its end marker set
    to `body`."""
    begin, end = f"<!-- report:{name} begin -->", f"<!-- report:{name} end -->"
    if begin not in text or end not in text:
        raise ConfigError(f"{file}: no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + "\n".join(body) + "\n" + end + tail


def readme(text: str, points: list[ClaimPoint], board: Board, runs: Board | None = None) -> str:
    headline = [p for p in points if p.headline]
    counts = sorted({p.seeds for p in headline if p.seeds})
    seeds = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else (str(counts[0]) if counts else "no")
    claims = [
        f"Each paper's headline claim under its own Fashion-MNIST protocol ({seeds} seeds; every claim, its setting "
        "and reason in [docs/results.md](docs/results.md)):",
        "",
        *summary_table(headline, numbered=False),
        "",
        "![each claim's gain in its paper against ours](docs/img/claims.png)",
    ]
    text = replace_block(text, "claims", claims)
    return replace_block(text, "leaderboard", leaderboard_headline(board, runs))


# ---------------------------------------------------------------------------------------------- main


def generated_paths(root: Path) -> list[Path]:
    """Every file `fedskew report` writes (its text files and figures)."""
    docs = root / "docs"
    return [
        docs / "results.md",
        docs / "leaderboard.md",
        root / "README.md",
        root / PEERS_PAGE,
        *(docs / "img" / f for f in FIGURES),
    ]


FIGURES = ("claims.png", "leaderboard-gain.png")
PEERS_PAGE = Path("docs/notes/peers.md")


def _board(root: Path, suite_file: Path, ev: Evidence) -> Board:
    """The board of the suite at `root / suite_file` over its result file (named by the suite's `name`)."""
    suite = yaml.safe_load((root / suite_file).read_text())
    return Board(suite, ev.sets.get(suite.get("name", suite_file.stem)))


def generate(root: Path, figures: bool = True) -> dict[Path, str]:
    """The generated text files under `root` (path -> content); with `figures`, also draw the PNGs."""
    ev = Evidence(load_all(root / "results"))
    claims = load_claims(root / "results" / "claims.yaml")
    board = _board(root, LEADERBOARD_SUITE, ev)
    long = _board(root, CONVERGED_SUITE, ev) if (root / CONVERGED_SUITE).is_file() else None
    first = _board(root, CONVERGED_RUNS, ev) if (root / CONVERGED_RUNS).is_file() else None
    points = claim_points(claims, ev)
    out = {
        root / "docs" / "results.md": results_md(claims, ev),
        root / "docs" / "leaderboard.md": leaderboard_md(LEADERBOARD_SUITE, board, root, long, first),
        root / "README.md": readme((root / "README.md").read_text(), points, board, first),
        root / PEERS_PAGE: replace_block(
            (root / PEERS_PAGE).read_text(), PEERS_BLOCK, peers_block(root, ev.sets), PEERS_PAGE.as_posix()
        ),
    }
    if figures:
        (root / "docs" / "img").mkdir(parents=True, exist_ok=True)
        claims_figure(points, root / "docs" / "img" / FIGURES[0])
        leaderboard_figure(board, root / "docs" / "img" / FIGURES[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedskew report", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the checkout (default: the current folder)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.check:
        try:
            files = generate(root, figures=False)
        except ConfigError as e:
            print(f"fedskew report: {e}", file=sys.stderr)
            return 2
        stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
        for p in stale:
            print(f"stale: {p} (run `fedskew report`)", file=sys.stderr)
        return 1 if stale else 0
    try:
        with locked(generated_paths(root)):  # one report at a time: each file whole, from one reading
            files = generate(root)
            for p, text in files.items():
                write_text(p, text)
    except ConfigError as e:
        print(f"fedskew report: {e}", file=sys.stderr)
        return 2
    print(f"fedskew report: wrote {', '.join(str(p) for p in files)} and docs/img/claims.png, leaderboard-gain.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
