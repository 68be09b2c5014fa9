"""One-off migration (run once): the tables of docs/results.md at commit 9caf598 -> results/*.yaml.

The run folders behind that report are gone; its numbers exist only in its tables (and a few in
its text). This script reads the old report from git, maps each table row and column to a result
file's cell and statistic, writes the files, then checks them: every migrated number is re-read
from the written file (through `fedskew.resultfile.load_results`) and compared with the number in
the old table cell it came from, and every number of a mapped table cell is either migrated or
named as left out (a gain in parentheses, a seed-0 aside). Run from the repository root:

    .venv/bin/python scripts/migrate_results.py [--check-only]

Tables not migrated (their rows are not suite cells; they stay in docs/notes/): MAP's settings
explored in-process (seed 0), the MuPFL BAVD readings and the FedGELA geometry (benchmark outputs).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from fedskew.resultfile import CellResult, ResultSet, Stat, dump_results, load_results

COMMIT = "9caf598"
SOURCE = f"migrated from docs/results.md at {COMMIT} (mean ± std as its tables gave them); per-seed values: not kept"
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results"

# one migrated number: (file, partition, method, stat name, field 'mean'|'std', value, where it came from)
records: list[tuple[str, str, str, str, str, float, str]] = []
consumed: dict[str, list[float]] = defaultdict(list)  # provenance -> numbers taken from that text


def old_report() -> str:
    return subprocess.run(
        ["git", "show", f"{COMMIT}:docs/results.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


TEXT = old_report()
LINES = TEXT.split("\n")


def tables() -> list[list[list[str]]]:
    out, cur = [], None
    for line in LINES:
        if line.startswith("|"):
            if cur is None:
                cur = []
                out.append(cur)
            cur.append([c.strip() for c in line.strip().strip("|").split("|")])
        else:
            cur = None
    return out


TABLES = tables()
PART = re.compile(r"^\**\s*(-?\d+(?:\.\d+)?)\s*(?:±\s*(\d+(?:\.\d+)?))?\s*\**\s*(?:\((\d+\.\d+)\))?")


def parse(text: str) -> list[tuple[float, float | None, float | None]]:
    """'a ± b (osc) / c ± d' -> [(a, b, osc), (c, d, None)]; '-' or '' -> []."""
    text = text.strip()
    if text in ("", "-"):
        return []
    parts = []
    for piece in text.split(" / "):
        m = PART.match(piece.strip())
        if not m:
            raise ValueError(f"cannot parse {piece!r} in {text!r}")
        parts.append((float(m[1]), float(m[2]) if m[2] else None, float(m[3]) if m[3] else None))
    return parts


def put(where: str, file: str, partition: str, method: str, stat: str, mean: float, std: float | None) -> None:
    records.append((file, partition, method, stat, "mean", mean, where))
    consumed[where].append(mean)
    if std is not None:
        records.append((file, partition, method, stat, "std", std, where))
        consumed[where].append(std)


def row_of(t: int, label: str) -> tuple[int, list[str]]:
    for i, row in enumerate(TABLES[t][2:]):
        if row[0] == label:
            return i, row
    raise KeyError(f"table {t}: no row {label!r}")


def cell(t: int, label: str, col: int, targets: list[tuple[str, str, str, str]], osc: str | None = None) -> None:
    """Table `t`, the row labelled `label`, column `col` (0 = the label): its ' / '-separated values
    go to `targets` [(file, partition, method, stat)], one each; a value's '(x)' to `osc` (the stat
    name of the oscillation over the same rounds, same cell)."""
    i, row = row_of(t, label)
    where = f"table {t} row {i} col {col}"
    values = parse(row[col])
    if not values:  # '-' or empty: not measured
        return
    if len(values) != len(targets):
        raise ValueError(f"{where}: {len(values)} values for {len(targets)} targets: {row[col]!r}")
    for (mean, std, paren), (file, p, m, stat) in zip(values, targets, strict=True):
        put(where, file, p, m, stat, mean, std)
        if paren is not None:
            if osc is None:
                raise ValueError(f"{where}: a '(x)' with no oscillation stat")
            put(where, file, p, m, osc, paren, None)


def text_value(snippet: str, file: str, p: str, m: str, stat: str, mean: float, std: float | None = None) -> None:
    """A number from the old report's text: `snippet` must occur in it verbatim and hold the numbers."""
    if snippet not in TEXT:
        raise ValueError(f"not in the old report: {snippet!r}")
    for v in (mean, std):
        if v is not None and f"{v}" not in snippet and f"{v:.2f}" not in snippet:
            raise ValueError(f"{v} not in {snippet!r}")
    put(f"text {snippet!r}", file, p, m, stat, mean, std)


# ------------------------------------------------------------------------------------------ the mapping


def common_setting() -> None:
    f = "fmnist-pcdd"
    labels = {
        "fedavg": "fedavg",
        "fedprox (mu 0.01)": "fedprox",
        "fedrs (alpha 0.5)": "fedrs",
        "map": "map",
        "fedgela (after issue 13)": "fedgela",
        "fedmr": "fedmr",
        "mupfl (after issue 13)": "mupfl",
    }
    for label, m in labels.items():
        for col, stat in ((1, "global.final"), (2, "global.best"), (3, "personalized.final")):
            cell(0, label, col, [(f, "c2", m, stat)])
        label1 = label.replace(" (mu 0.01)", "").replace(" (alpha 0.5)", "")
        for col, stat in ((1, "global.last10"), (2, "global.osc10"), (3, "personalized.last10")):
            cell(1, label1, col, [(f, "c2", m, stat)])
    text_value("FedGELA 52.7 ± 1.9", f, "c2", "fedgela", "client-global.last10", 52.7, 1.9)
    text_value("MuPFL 50.6 ± 5.7", f, "c2", "mupfl", "client-global.last10", 50.6, 5.7)

    # fmnist-skew: split | method | global last10 | osc | client-global last10 | personalized last10 | final | best
    for i, row in enumerate(TABLES[2][2:]):
        split, label = row[0], row[1]
        m = label.replace(" (-FT)", "")
        for col, stat in (
            (2, "global.last10"),
            (3, "global.osc10"),
            (4, "client-global.last10"),
            (5, "personalized.last10"),
            (6, "global.final"),
            (7, "global.best"),
        ):
            ((mean, std, _),) = parse(row[col])
            put(f"table 2 row {i} col {col}", "fmnist-skew", split, m, stat, mean, std)

    # fmnist-fedgela-ew (seed 0): rows partitions, columns methods, 'global / personalized'
    methods = {
        1: "fedgela-ew1e2",
        2: "fedgela-ew3e2",
        3: "fedgela-ew1e3",
        4: "fedgela-ew3e3",
        5: "fedgela-ew1e4",
        6: "fedavg",
        7: "fedgela-code",
    }
    for label, p in (("Dirichlet(0.1)", "dir01"), ("2 classes per client", "c2")):
        for col, m in methods.items():
            cell(
                6,
                label,
                col,
                [("fmnist-fedgela-ew", p, m, "global.last10"), ("fmnist-fedgela-ew", p, m, "personalized.last10")],
            )


def map_common() -> None:
    f = "fmnist-map"
    for label in ("fedavg", "fedrs", "map"):
        for col, stat in (
            (1, "global.final"),
            (2, "global.best"),
            (3, "personalized.final"),
            (4, "global.last10"),
            (5, "personalized.last10"),
        ):
            cell(3, label, col, [(f, "map", label, stat)])
    f = "fmnist-map50"
    labels = {
        "fedavg (1 epoch)": "fedavg",
        "fedavg-2ep (2 epochs)": "fedavg-2ep",
        "fedrs (alpha 0.5)": "fedrs",
        "map (HPM)": "map",
    }
    for label, m in labels.items():
        for col, stat in (
            (1, "global.final"),
            (2, "personalized.final"),
            (3, "global.last10"),
            (4, "personalized.last10"),
        ):
            cell(4, label, col, [(f, "map", m, stat)])
    cell(4, "map, stage-2 model theta_hat", 4, [(f, "map", "map", "stage2.last10")])


def fedmr() -> None:
    f = "paper-fedmr"
    kinds = {
        "FedAvg": "fedavg",
        "FedProx": "fedprox",
        "FedMR": "fedmr",
        "FedMR, intra-class loss only (mu2 = 0)": "fedmr-intra",
        "FedMR, inter-class loss only (mu1 = 0)": "fedmr-inter",
    }
    for split in ("P5C2", "P10C2", "P10C3", "P10C5", "IID"):
        for kind, m in kinds.items():
            # IID's ablation ran on the rerun's machine (2026-11-26), not beside the first IID runs
            file = "paper-fedmr-iid-rerun" if split == "IID" and m.startswith("fedmr-") else f
            for col, stat in ((2, "global.last10"), (3, "global.final"), (4, "global.best")):
                cell(7, f"{split} {kind}", col, [(file, split.lower(), m, stat)])
    for label, m in (
        ("IID FedAvg, rerun (2026-11-26, another machine)", "fedavg"),
        ("IID FedMR, rerun", "fedmr"),
        ("IID FedProx, rerun", "fedprox"),
    ):
        for col, stat in ((2, "global.last10"), (3, "global.final"), (4, "global.best")):
            cell(7, label, col, [("paper-fedmr-iid-rerun", "iid", m, stat)])


def mupfl() -> None:
    f = "paper-mupfl"
    cols = ((2, "last10"), (3, "final"), (4, "best"))
    for t, p in ((8, "if10-a05"), (9, "if100-a05"), (11, "if10-a1"), (13, "if100-a1")):
        rows = {
            "FedAvg, client-global": [("fedavg", "client-global")],
            "FedProx (mu 0.01), client-global": [("fedprox", "client-global")],
            "FedAvg-FT, personalized": [("fedavg", "personalized")],
            "MuPFL, personalized": [("mupfl", "personalized")],
            "MuPFL, client-global": [("mupfl", "client-global")],
            "FedAvg / MuPFL, global (10,000 test images)": [("fedavg", "global"), ("mupfl", "global")],
        }
        if t == 8:
            rows.update(
                {
                    "FedProx, mu 0.1 / 1.0 (seed 0 only), client-global": [
                        ("fedprox-0.1", "client-global"),
                        ("fedprox-1", "client-global"),
                    ],
                    "MuPFL, BAVD rescaled (`mupfl-bavd-rescale`), personalized / client-global / global": [
                        ("mupfl-rescaled", "personalized"),
                        ("mupfl-rescaled", "client-global"),
                        ("mupfl-rescaled", "global"),
                    ],
                    "MuPFL without ACMU, personalized / client-global / global": [
                        ("mupfl-no-acmu", "personalized"),
                        ("mupfl-no-acmu", "client-global"),
                        ("mupfl-no-acmu", "global"),
                    ],
                    "MuPFL without PKCF, personalized / client-global / global": [
                        ("mupfl-no-pkcf", "personalized"),
                        ("mupfl-no-pkcf", "client-global"),
                        ("mupfl-no-pkcf", "global"),
                    ],
                    "MuPFL without BAVD, personalized / client-global / global": [
                        ("mupfl-no-bavd", "personalized"),
                        ("mupfl-no-bavd", "client-global"),
                        ("mupfl-no-bavd", "global"),
                    ],
                }
            )
        for label, targets in rows.items():
            for col, stat in cols:
                cell(t, label, col, [(f, p, m, f"{metric}.{stat}") for m, metric in targets])
    # the ablation tables: personalized | client-global | global (oscillation) | global, final / best
    for t, p in ((10, "if100-a05"), (12, "if10-a1"), (14, "if100-a1")):
        for label, m in (
            ("all three modules", "mupfl"),
            ("without BAVD", "mupfl-no-bavd"),
            ("without ACMU", "mupfl-no-acmu"),
            ("without PKCF", "mupfl-no-pkcf"),
            ("FedAvg (-FT: personalized)", "fedavg"),
        ):
            cell(t, label, 1, [(f, p, m, "personalized.last10")])
            cell(t, label, 2, [(f, p, m, "client-global.last10")])
            cell(t, label, 3, [(f, p, m, "global.last10")], osc="global.osc10")
            cell(t, label, 4, [(f, p, m, "global.final"), (f, p, m, "global.best")])


def fedgela() -> None:
    f = "paper-fedgela"
    base = {
        "FedAvg, GA": ("fedavg", "global"),
        "FedRS, GA": ("fedrs", "global"),
        "FedGELA, GA": ("fedgela", "global"),
        "FedGE (global ETF, no local adaptation: `fedge`), GA": ("fedge", "global"),
        "FedAvg, PA of its global model": ("fedavg", "client-global"),
        "FedAvg-FT, PA": ("fedavg", "personalized"),
        "FedRS, PA (its locally trained model)": ("fedrs", "personalized"),
        "FedGELA, PA": ("fedgela", "personalized"),
        "FedGE, PA (its own backbone, plain ETF)": ("fedge", "personalized"),
    }
    for t, p in (
        (16, "part-a01"),
        (18, "part-a05"),
        (19, "part-a02"),
        (20, "full-a01-r20"),
        (23, "full-a05-r20"),
        (21, "full-a01"),
    ):
        for row in TABLES[t][2:]:
            m, metric = base[row[0]]
            for col, stat in ((2, "last10"), (3, "final"), (4, "best")):
                cell(t, row[0], col, [(f, p, m, f"{metric}.{stat}")])
    for label, m in (("FedAvg", "fedavg"), ("FedGELA", "fedgela")):
        for col, window in enumerate(("r1-10", "r11-20", "r21-30", "r31-40", "r41-50"), start=1):
            cell(22, label, col, [(f, "full-a01", m, f"global.{window}")])
    # the oscillation, from the text
    text_value("last 10 rounds, mean over seeds, is 0.28 points", f, "part-a05", "fedgela", "global.osc10", 0.28)
    text_value("against FedRS's 0.48 and FedAvg's 1.15", f, "part-a05", "fedrs", "global.osc10", 0.48)
    text_value("against FedRS's 0.48 and FedAvg's 1.15", f, "part-a05", "fedavg", "global.osc10", 1.15)
    text_value("GA over the last 10 rounds is 0.47\npoints", f, "part-a02", "fedgela", "global.osc10", 0.47)
    text_value("against FedRS's 1.18 and FedAvg's 2.38", f, "part-a02", "fedrs", "global.osc10", 1.18)
    text_value("against FedRS's 1.18 and FedAvg's 2.38", f, "part-a02", "fedavg", "global.osc10", 2.38)


def map_paper() -> None:
    f = "paper-map"
    labels = {
        "FedAvg, global": ("fedavg", "global"),
        "FedRS (alpha 0.5), global": ("fedrs", "global"),
        "MAP, global": ("map", "global"),
        "FedAvg, client-global": ("fedavg", "client-global"),
        "FedRS, client-global": ("fedrs", "client-global"),
        "MAP, client-global": ("map", "client-global"),
        "FedAvg-FT, personalized": ("fedavg", "personalized"),
        "FedRS, personalized (its locally trained model)": ("fedrs", "personalized"),
        "MAP, personalized (HPM)": ("map", "personalized"),
        "MAP (`map-code`), global": ("map-code", "global"),
        "MAP (`map-code`), client-global": ("map-code", "client-global"),
        "MAP (`map-code`), its stage-2 model": ("map-code", "stage2"),
        "MAP (`map-code`), personalized (HPM)": ("map-code", "personalized"),
    }
    for t, p, cols in (
        (24, "map-r50", ((1, "last10"), (3, "final"), (4, "best"))),
        (25, "map", ((1, "last10"), (3, "final"), (4, "best"))),
        (26, "map-r50", ((1, "last10"), (3, "final"), (4, "best"))),
        (27, "map", ((1, "last10"), (2, "final"), (3, "best"))),
    ):
        for row in TABLES[t][2:]:
            m, metric = labels[row[0]]
            for col, stat in cols:
                cell(t, row[0], col, [(f, p, m, f"{metric}.{stat}")])
            if t != 27 and row[2]:
                cell(t, row[0], 2, [(f, p, m, "global.osc10")])
    text_value("`map`'s 90.28", f, "map", "map", "stage2.last10", 90.28)


def fedrs() -> None:
    f = "paper-fedrs"
    labels = {
        "FedAvg": "fedavg",
        "FedRS (alpha 0.5)": "fedrs-0.5",
        "FedRS (alpha 0.9)": "fedrs-0.9",
        "FedRS (alpha 0.1)": "fedrs-0.1",
    }
    for t, suffix in ((28, "-r150"), (29, "")):
        for row in TABLES[t][2:]:
            scene, _, kind = row[0].partition(" ")
            p, m = scene.lower() + suffix, labels[kind]
            for col, stat in ((2, "global.last50"), (3, "global.osc50"), (4, "global.final"), (5, "global.best")):
                cell(t, row[0], col, [(f, p, m, stat)])
    text_value("FedAvg 81.69 (3.84)", f, "c10-100-2-r1000", "fedavg", "global.last50", 81.69)
    text_value("FedAvg 81.69 (3.84)", f, "c10-100-2-r1000", "fedavg", "global.osc50", 3.84)
    text_value("alpha 0.9 84.31 (1.66)", f, "c10-100-2-r1000", "fedrs-0.9", "global.last50", 84.31)
    text_value("alpha 0.9 84.31 (1.66)", f, "c10-100-2-r1000", "fedrs-0.9", "global.osc50", 1.66)
    text_value("alpha 0.5 86.85 (0.21)", f, "c10-100-2-r1000", "fedrs-0.5", "global.last50", 86.85)
    text_value("alpha 0.5 86.85 (0.21)", f, "c10-100-2-r1000", "fedrs-0.5", "global.osc50", 0.21)
    # TFCNN on a GPU, and the map-lenet CPU runs over the same rounds
    g = "paper-fedrs-tfcnn"
    for label in ("FedAvg", "FedRS (alpha 0.5)", "FedRS (alpha 0.9)"):
        m = labels[label]
        cell(30, label, 2, [(g, "c10-100-2", m, "global.r101-150")])
        cell(30, label, 3, [(g, "c10-100-2", m, "global.r244-293")])
        cell(30, label, 4, [(g, "c10-100-2", m, "global.osc244-293")])
        cell(30, label, 5, [(f, "c10-100-2", m, "global.r244-293")])
    for label in ("FedAvg", "FedRS (alpha 0.5)"):
        m = labels[label]
        cell(31, label, 2, [(g, "c10-100-5", m, "global.r88-137")])
        cell(31, label, 3, [(g, "c10-100-5", m, "global.osc88-137")])
        cell(31, label, 4, [(f, "c10-100-5", m, "global.r88-137")], osc="global.osc88-137")


# ------------------------------------------------------------------------------------------ cells, files

NOTES = {
    ("paper-fedrs", "c10-100-2-r1000"): "seed 0 only: seeds 1 and 2 stopped part-way",
    ("paper-fedgela", "full-a01"): "started on a lent GPU (H200) and finished on the CPU from checkpoints "
    "(FedAvg's at round 20, FedGELA's at 15): not a one-device run to the digit",
    ("paper-fedrs-tfcnn", "c10-100-2"): "TFCNN on one H200, stopped at 464 s: FedAvg at 300 rounds, FedRS at "
    "293-297, so the last common 50 rounds are 244-293",
    ("paper-fedrs-tfcnn", "c10-100-5"): "TFCNN on one H200, 150 rounds set, stopped after 137-143 rounds "
    "(a 175 s deadline), so the last common 50 rounds are 88-137",
    ("paper-fedmr-iid-rerun", "iid"): "IID on a second machine (2026-11-26): the ablation, and FedAvg, FedMR and "
    "FedProx rerun beside it; the first IID runs are in paper-fedmr",
}
FILES = {  # file -> (suite, suite file, overrides)
    "fmnist-pcdd": ("fmnist-pcdd", "suites/fmnist-pcdd.yaml", {}),
    "fmnist-skew": ("fmnist-skew", "suites/fmnist-skew.yaml", {}),
    "fmnist-fedgela-ew": ("fmnist-fedgela-ew", "suites/fmnist-fedgela-ew.yaml", {}),
    "fmnist-map": ("fmnist-map", "suites/fmnist-map.yaml", {}),
    "fmnist-map50": ("fmnist-map50", "suites/fmnist-map50.yaml", {}),
    "paper-fedmr": ("paper-fedmr", "suites/paper-fedmr.yaml", {}),
    "paper-fedmr-iid-rerun": ("paper-fedmr", "suites/paper-fedmr.yaml", {}),
    "paper-mupfl": ("paper-mupfl", "suites/paper-mupfl.yaml", {}),
    "paper-fedgela": ("paper-fedgela", "suites/paper-fedgela.yaml", {}),
    "paper-map": ("paper-map", "suites/paper-map.yaml", {}),
    "paper-fedrs": ("paper-fedrs", "suites/paper-fedrs.yaml", {}),
    "paper-fedrs-tfcnn": ("paper-fedrs", "suites/paper-fedrs.yaml", {"model": "tfcnn", "device": "cuda"}),
}
SEED0 = {("paper-mupfl", "if10-a05", "fedprox-0.1"), ("paper-mupfl", "if10-a05", "fedprox-1")}


def suite_cell(suite_file: str, partition: str, method: str) -> tuple[dict, list[int]]:
    raw = yaml.safe_load((ROOT / suite_file).read_text())
    p_over = dict(raw["partitions"][partition] or {})
    p_over.pop("num-supernodes", None)
    m_over = raw["methods"][method] or {}
    return {**raw.get("base", {}), **p_over, "method": method, **m_over}, raw["seeds"]


def build() -> dict[str, ResultSet]:
    cells: dict[tuple[str, str, str], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for file, p, m, stat, fld, value, where in records:
        have = cells[(file, p, m)][stat]
        if fld in have and have[fld] != value:
            raise ValueError(f"{file}/{p}/{m} {stat}.{fld}: {have[fld]} and {value} ({where})")
        have[fld] = value
    sets: dict[str, ResultSet] = {}
    for (file, p, m), stats in cells.items():
        suite, suite_file, overrides = FILES[file]
        config, seeds = suite_cell(suite_file, p, m)
        config = {**config, **overrides}
        if file == "fmnist-fedgela-ew" or (file, p, m) in SEED0 or p == "c10-100-2-r1000":
            seeds = [0]
        rs = sets.setdefault(file, ResultSet(file, suite, suite_file, [], overrides))
        rs.cells.append(
            CellResult(
                partition=p,
                method=m,
                seeds=seeds,
                rounds=int(config["num-server-rounds"]),
                config=config,
                stats={name: Stat(v["mean"], v.get("std")) for name, v in stats.items()},
                source=SOURCE,
                note=NOTES.get((file, p), ""),
            )
        )
    return sets


def check() -> None:
    """Re-read every written file and compare each migrated number with the old report's; list every
    number of a mapped table cell that was not migrated (for review: gains in parentheses, asides)."""
    loaded = {p.stem: load_results(p) for p in OUT.glob("*.yaml") if p.stem in FILES}
    bad = 0
    for file, p, m, stat, fld, value, where in records:
        c = loaded[file].cell(p, m)
        got = None if c is None or stat not in c.stats else getattr(c.stats[stat], fld)
        if got != value:
            bad += 1
            print(f"MISMATCH {file}/{p}/{m} {stat}.{fld}: file {got}, old report {value} ({where})")
    for where, taken in consumed.items():
        if not where.startswith("table"):
            continue
        t, i, col = map(int, re.match(r"table (\d+) row (\d+) col (\d+)$", where).groups())
        text = TABLES[t][i + 2][col]
        left = [float(x) for x in re.findall(r"(?<![\d.])\d+\.\d+", text)]
        for v in taken:
            left.remove(v)  # ValueError: a number migrated that the cell does not hold
        if left:
            print(f"not migrated from {where} ({TABLES[t][i + 2][0]!r}): {left}  <- {text!r}")
    # each mean and its std re-rendered from the file as the tables write them ("a ± b")
    pairs = defaultdict(dict)
    for file, p, m, stat, fld, _, where in records:
        pairs[(file, p, m, stat, where)][fld] = True
    for (file, p, m, stat, where), fields in pairs.items():
        if where.startswith("table") and "std" in fields:
            t, i, col = map(int, re.match(r"table (\d+) row (\d+) col (\d+)$", where).groups())
            s = loaded[file].cell(p, m).stats[stat]
            shown = f"{s.mean:.2f} ± {s.std:.2f}"
            if shown not in TABLES[t][i + 2][col].replace("**", ""):
                bad += 1
                print(f"MISMATCH {file}/{p}/{m} {stat}: {shown!r} not in {TABLES[t][i + 2][col]!r}")
    n = len(records)
    print(f"{n} numbers migrated into {len(loaded)} files; {bad} mismatches")
    if bad:
        sys.exit(1)


def main() -> None:
    common_setting()
    map_common()
    fedmr()
    mupfl()
    fedgela()
    map_paper()
    fedrs()
    if "--check-only" not in sys.argv:
        OUT.mkdir(exist_ok=True)
        for name, rs in build().items():
            dump_results(rs, OUT / f"{name}.yaml")
    check()


if __name__ == "__main__":
    main()
