"""The generated reports: the committed docs are what the committed result files give, an edited
number changes them, result files are checked when read, a suite's runs export into them."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedskew.config import ConfigError, validate
from fedskew.reports.leaderboard import (
    Board,
    budget_section,
    leaderboard_headline,
    leaderboard_md,
    leaderboard_verdict,
    looks,
)
from fedskew.reports.report import (
    Claims,
    Evidence,
    Numbers,
    Paper,
    Row,
    Table,
    generate,
    judged_verdict,
    numbers,
    render_reason,
    shown_verdict,
    unpaired_claim_cells,
)
from fedskew.reports.resultfile import (
    CellResult,
    ResultSet,
    Stat,
    config_sha256,
    dump_results,
    export_suite,
    load_all,
    load_results,
)
from fedskew.reports.stats import Interval, rank_correlation
from fedskew.run.experiments import load_suite, select, stale_cells
from fedskew.server_app.results import resumed_rounds, run_seconds, saved_config
from tests.harness import ROOT, app_defaults

GENERATED = ("docs/results.md", "docs/leaderboard.md", "README.md", "docs/notes/peers.md")


def copy_inputs(tmp_path: Path) -> Path:
    """What `fedskew report` reads, copied: results/, the leaderboard suite, README.md, the peers' page."""
    shutil.copytree(ROOT / "results", tmp_path / "results")
    (tmp_path / "suites").mkdir()
    shutil.copy(ROOT / "suites" / "leaderboard.yaml", tmp_path / "suites")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    (tmp_path / "docs" / "notes").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "notes" / "peers.md", tmp_path / "docs" / "notes")
    return tmp_path


def test_committed_docs_are_what_the_committed_results_give() -> None:
    """`fedskew report` run on the committed results/ rewrites nothing: text and numbers agree."""
    files = generate(ROOT, figures=False)
    for name in GENERATED:
        assert files[ROOT / name] == (ROOT / name).read_text(), f"{name} is stale: run `fedskew report`"


def test_the_committed_leaderboard_is_today_s_config() -> None:
    """Every cell of results/leaderboard.yaml carries the config hash a run of the suite's cell would
    record today: no number of an earlier default, revision or method key set is shown as current
    (a method added beside FedAvg's classes once changed FedAvg's hash and would have dropped its
    recorded seeds on the next export)."""
    suite = load_suite(ROOT / "suites" / "leaderboard.yaml", app_defaults())
    assert stale_cells(suite, ROOT, app_defaults()) == []


def test_a_cell_recorded_under_another_default_is_stale(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    suite = load_suite(root / "suites" / "leaderboard.yaml", app_defaults())
    results = load_results(root / "results" / "leaderboard.yaml")
    cell = next(c for c in results.cells if c.method == "fedrs" and c.partition == "c2")
    stale = replace(cell, config_sha256=config_sha256({**validate({"method": "fedrs"}), "fedrs-alpha": 0.25}))
    dump_results(
        replace(results, cells=[stale if c is cell else c for c in results.cells]),
        root / "results" / "leaderboard.yaml",
    )
    assert stale_cells(suite, root, app_defaults()) == ["c2/fedrs"]


def test_editing_a_committed_number_changes_the_docs(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    before = generate(root, figures=False)[root / "docs" / "results.md"]
    assert "| C10-100-2 FedRS (alpha 0.5) | 70.8 (+14.9) | 85.28 ± 0.43 (+8.0 [" in before
    path = root / "results" / "paper-fedrs.yaml"
    text = path.read_text()
    old = "- partition: c10-100-2\n  method: fedrs-0.5\n"
    start = text.index(old)
    cell = text[start:].split("\n- partition:")[0]
    assert "global.last50: {mean: 85.28, std: 0.43}" in cell
    path.write_text(text[:start] + cell.replace("mean: 85.28,", "mean: 75.28,") + text[start + len(cell) :])
    after = generate(root, figures=False)
    results, readme = after[root / "docs" / "results.md"], after[root / "README.md"]
    row = next(line for line in results.splitlines() if line.startswith("| C10-100-2 FedRS (alpha 0.5) |"))
    assert "| 75.28 ± 0.43 (-2.0 [" in row and "(unpaired)" in row  # Welch: no per-seed values kept
    # a "holds" whose gain now lies on the other side of 0 is re-judged, the written verdict shown
    old_row = next(line for line in before.splitlines() if line.startswith("| C10-100-2 FedRS (alpha 0.5) |"))
    assert "**fails** (written: holds" in row and "written:" not in old_row
    assert "-2.0 [" in readme  # the headline table follows too
    assert "protocol (3 seeds; every claim" in readme  # the seeds its headline intervals are over


def iv(low: float, high: float, n: int = 10) -> Interval:
    return Interval((low + high) / 2, low, high, n, 1.0)


@pytest.mark.parametrize(
    ("written", "interval", "level", "judged"),
    [
        ("holds", iv(0.5, 3.0), False, "holds"),  # on the paper's side (+): stays
        ("holds", iv(-0.5, 3.0), False, "direction holds"),  # includes 0, mean on the paper's side
        ("holds", iv(-3.0, 0.5), False, "fails"),  # mean on the other side
        ("direction holds", iv(-3.0, -0.5), False, "fails"),  # the other side, established
        ("direction holds", iv(-0.5, 3.0), False, "direction holds"),
        ("fails", iv(0.2, 0.8), False, "direction holds"),  # a small gain, but established
        ("fails", iv(-0.5, 3.0), False, "fails"),
        ("holds", iv(-0.6, 0.8), True, "holds"),  # level: the whole interval within +-1 point
        ("fails", iv(-0.6, 0.8), True, "holds"),
        ("holds", iv(1.4, 3.2), True, "fails"),  # level: beyond +-1 point on one side
        ("direction holds", iv(-0.5, 3.0), True, "direction holds"),  # level: too wide to tell
        ("holds", Interval(2.0, math.nan, math.nan, 1, math.nan), False, "holds"),  # 1 seed: no interval
    ],
)
def test_a_written_verdict_is_re_judged_by_its_paired_interval(
    written: str, interval: Interval, level: bool, judged: str
) -> None:
    row = Row("r", "f/p/m", "global.last10", paper=70.0, vs="f/p/b", vs_paper=65.0, verdict=written, level=level)
    nums = Numbers(Stat(70.0), Stat(65.0), interval.mean, interval, True, 5.0)
    assert judged_verdict(row, nums) == judged
    shown = shown_verdict(row, nums)
    assert shown.startswith(f"**{judged}**") and (f"written: {written}" in shown) == (judged != written)


def test_reasons_take_their_numbers_from_the_result_files() -> None:
    a = CellResult("p", "a", [0, 1], {"global.last10": Stat(80.0, 1.0), "global.osc10": Stat(0.5)})
    b = CellResult("p", "b", [0, 1], {"global.last10": Stat(70.0, 2.0), "global.osc10": Stat(2.0)})
    ev = Evidence({"f": ResultSet("f", "s", "suites/s.yaml", [a, b])})
    row = Row(
        "a over b",
        "f/p/a",
        "global.last10",
        vs="f/p/b",
        reason="{gain}; {f/p/b:global.osc10 / f/p/a:global.osc10}x; {f/p/a}",
    )
    nums = numbers(row, ev)
    assert nums.gain == 10.0 and not nums.paired  # no per-seed values: Welch's interval from the stds
    assert nums.interval is not None and nums.interval.low < 0 < 10.0 < nums.interval.high  # 2 seeds: wide
    assert render_reason(row, nums, ev) == "+10.0; 4.0x; 80.00"
    with pytest.raises(ConfigError, match=r"no statistic 'global\.best'"):
        numbers(Row("x", "f/p/a", "global.best"), ev)
    with pytest.raises(ConfigError, match="no result cell 'f/p/c'"):
        ev.cell("f/p/c")


def test_a_gain_is_paired_by_seed_when_both_cells_kept_their_values() -> None:
    """The same +1 on every seed: a zero-width paired interval, where the cells' stds (0.8 each)
    would give Welch's a wide one; other seeds pair only on those both hold."""
    a = CellResult("p", "a", [0, 1, 2], {"global.last10": Stat(2.0, 0.8165, [1.0, 2.0, 3.0])})
    b = CellResult("p", "b", [0, 1, 2], {"global.last10": Stat(1.0, 0.8165, [0.0, 1.0, 2.0])})
    c = CellResult("p", "c", [1, 2, 3], {"global.last10": Stat(1.5, 0.8165, [0.5, 1.5, 2.5])})
    ev = Evidence({"f": ResultSet("f", "s", "suites/s.yaml", [a, b, c])})
    nums = numbers(Row("a over b", "f/p/a", "global.last10", vs="f/p/b"), ev)
    assert nums.paired and (nums.interval.low, nums.interval.high, nums.interval.n) == (1.0, 1.0, 3)
    nums = numbers(Row("a over c", "f/p/a", "global.last10", vs="f/p/c"), ev)
    assert nums.paired and nums.interval.n == 2 and nums.gain == pytest.approx(1.5)  # seeds 1 and 2


def test_the_cells_to_run_again_are_those_of_claims_without_a_paired_interval() -> None:
    """A claim whose sides kept per-seed values on 2+ shared seeds needs nothing; one whose side kept
    only a mean and std, or whose sides share one seed, needs both its cells; a row that is no claim
    needs none (it is not re-judged)."""
    per_seed = {"global.last10": Stat(2.0, 0.8165, [1.0, 2.0, 3.0])}
    cells = [
        CellResult("p", "a", [0, 1, 2], per_seed),
        CellResult("p", "b", [0, 1, 2], per_seed),
        CellResult("p", "old", [0, 1, 2], {"global.last10": Stat(1.0, 0.5)}),  # migrated: no per-seed values
        CellResult("q", "one", [5, 6, 7], per_seed),
        CellResult("q", "two", [7, 8, 9], per_seed),
    ]
    ev = Evidence({"f": ResultSet("f", "s", "suites/s.yaml", cells)})
    rows = [
        Row("paired", "f/p/a", "global.last10", vs="f/p/b", claim="a beats b"),
        Row("unpaired", "f/p/a", "global.last10", vs="f/p/old", claim="a beats old"),
        Row("one seed shared", "f/q/one", "global.last10", vs="f/q/two", claim="one beats two"),
        Row("reference", "f/p/b", "global.last10", vs="f/p/old"),
    ]
    claims = Claims("", "")
    claims.papers.append(Paper("k", "K", "", "", [Table("T", "", "global.last10", rows)]))
    assert unpaired_claim_cells(claims, ev) == {"f": ["p/a", "p/old", "q/one", "q/two"]}


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c["stats"].update({"global.last10": {"mean": float("nan")}}), "global.last10.mean=nan"),
        (lambda c: c["stats"].update({"global.lastten": {"mean": 1.0}}), "'global.lastten' is not allowed"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "per-seed": [1.0]}}), "a list of 2 numbers"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "std": -1}}), "must be a number in [0, 100]"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1e308}}), "mean=1e+308 is not allowed"),
        (lambda c: c["stats"].update({"global.last10": {"mean": -1e308}}), "a percentage"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "std": 1e300}}), "std=1e+300"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "per-seed": [1.0, 1e308]}}), "per-seed[1]"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "sd": 1}}), "unknown key 'sd'"),
        (lambda c: c.update({"seeds": [0, 0]}), "distinct integers"),
        (lambda c: c.update({"wall-seconds": {5: 1.0}}), "one of the cell's seeds [0, 1]"),
        (lambda c: c.update({"wall-seconds": {0: -1.0}}), "wall-seconds[0]"),
        (lambda c: c.update({"wall-seconds": {0: 1e300}}), "must be seconds in"),
        (lambda c: c.update({"wall-seconds": [1.0]}), "a mapping of seed to seconds"),
        (lambda c: c.update({"processor": {"cpu (AVX2)": [0, 5]}}), "some of the cell's seeds [0, 1], each once"),
        (lambda c: c.update({"processor": {"a": [0], "b": [0]}}), "processor['b']"),
        (lambda c: c.update({"processor": {"x" * 201: [0]}}), "printable text of 1 to 200"),
        (lambda c: c.update({"processor": {"a\x1b[2J": [0]}}), "printable text"),
        (lambda c: c.update({"processor": ["a"]}), "a mapping of a processor's name"),
        (lambda c: c.pop("method"), "no method"),
    ],
)
def test_a_damaged_result_file_is_refused_naming_the_key(tmp_path: Path, edit, needle: str) -> None:
    cell = {"partition": "p", "method": "m", "seeds": [0, 1], "stats": {"global.last10": {"mean": 50.0}}}
    edit(cell)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"suite": "s", "cells": [cell]}))
    with pytest.raises(ConfigError) as info:
        load_results(path)
    assert needle in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_result_file_reads_back_what_was_written(tmp_path: Path) -> None:
    cell = CellResult("p", "m", [0, 1], {"global.last10": Stat(50.0, 1.5, [48.5, 51.5])}, rounds=30, note="n")
    cell.wall_seconds = {1: 282.1}
    cell.processor = {0: "AMD EPYC 7B13 (AVX2)", 1: "Intel(R) Xeon(R) Processor (AVX512)"}
    dump_results(ResultSet("x", "s", "suites/s.yaml", [cell], {"model": "tfcnn"}), tmp_path / "x.yaml")
    back = load_results(tmp_path / "x.yaml")
    assert back.cells == [cell] and back.overrides == {"model": "tfcnn"} and back.suite_file == "suites/s.yaml"
    assert "global.last10: {mean: 50.0, std: 1.5, per-seed: [48.5, 51.5]}" in (tmp_path / "x.yaml").read_text()


SUITE = """
name: t
num-supernodes: 5
seeds: [0, 1]
out-dir: {out}
base: {{num-server-rounds: 3, partition: iid, model: mlp}}
methods:
  fedavg: {{}}
  rs: {{method: fedrs, fedrs-alpha: 0.5}}
partitions:
  iid: {{}}
"""


def fake_run(suite, cell, accuracies: list[float], **config_changes) -> None:
    """A finished run folder as `fedskew run` leaves it: config.json, metrics.jsonl, summary.json."""
    d = suite.folder / cell.run_name
    d.mkdir(parents=True)
    cfg = validate({**app_defaults(), **cell.overrides, "num-partitions": cell.num_supernodes, **config_changes})
    (d / "config.json").write_text(json.dumps(saved_config(cfg)))
    rows = [{"round": r, "global-accuracy": a, "personalized-accuracy": 0.9} for r, a in enumerate(accuracies, 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"wall_seconds": 1.0}))


def export_setup(tmp_path: Path) -> tuple[Any, dict[tuple[str, int], Any]]:
    """The test suite `SUITE` under `tmp_path`, its cells by (method, seed), and an empty results/."""
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    (tmp_path / "results").mkdir()
    return suite, {(c.method, c.seed): c for c in suite.cells}


def test_export_writes_a_suites_cells_and_keeps_the_files_others(tmp_path: Path) -> None:
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    cells = {(c.method, c.seed): c for c in suite.cells}
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5, 0.6])
    fake_run(suite, cells[("rs", 0)], [0.7, 0.8, 0.9], lr=0.5)  # computed under another config: left out
    folder = tmp_path / "results"
    folder.mkdir()
    kept = CellResult("old", "m", [0], {"global.last10": Stat(1.0)}, source="migrated")
    dump_results(ResultSet("t", "t", "suites/t.yaml", [kept]), folder / "t.yaml")
    with pytest.warns(UserWarning, match="computed under another config"):
        path = export_suite(suite, "suites/t.yaml", app_defaults(), folder)
    rs = load_results(path)
    assert [(c.partition, c.method) for c in rs.cells] == [("iid", "fedavg"), ("old", "m")]
    fedavg = rs.cells[0]
    assert fedavg.seeds == [0, 1] and fedavg.rounds == 3 and fedavg.config_sha256
    assert fedavg.config == {k: v for k, v in cells[("fedavg", 0)].overrides.items() if k != "seed"}
    last = fedavg.stats["global.last10"]  # the mean of rounds 1-3, percent
    assert last.per_seed == [60.0, 50.0] and last.mean == 55.0 and last.std == 5.0
    assert fedavg.stats["global.final"].per_seed == [70.0, 60.0]
    assert fedavg.stats["global.osc10"].mean == pytest.approx(8.165, abs=1e-3)
    assert fedavg.stats["personalized.last10"].mean == 90.0
    assert "balanced.last10" not in fedavg.stats  # not in these runs' metrics: not invented
    # a cell exported again replaces its entry: rs's seed 0 now with the suite's config; a note
    # written by hand on a replaced cell stays with it
    (suite.folder / cells[("rs", 0)].run_name).rename(tmp_path / "aside")
    fake_run(suite, cells[("rs", 0)], [0.7, 0.8, 0.9])
    dump_results(replace(rs, cells=[replace(rs.cells[0], note="rounds 1-2 on a GPU"), *rs.cells[1:]]), path)
    rs2 = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), folder))
    assert [(c.partition, c.method) for c in rs2.cells] == [("iid", "fedavg"), ("iid", "rs"), ("old", "m")]
    assert rs2.cells[1].seeds == [0] and rs2.cells[1].stats["global.best"].mean == 90.0
    assert [c.note for c in rs2.cells] == ["rounds 1-2 on a GPU", "", ""]


def test_export_of_runs_elsewhere_under_overrides_names_them_and_checks_them(tmp_path: Path) -> None:
    """`benchmarks/suite_in_process.py --export`: runs in another folder, made with overrides (a GPU),
    go into their own result file that records the overrides; a run without them is left out, and
    an in-process run's saved num-partitions 0 (the nodes' count) is the suite's split."""
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    cells = {(c.method, c.seed): c for c in suite.cells}
    elsewhere = replace(suite, out_dir=tmp_path / "gpu")  # only its folder is another
    runs = elsewhere.folder
    fake_run(elsewhere, cells[("fedavg", 0)], [0.5, 0.6], device="cuda")
    fake_run(elsewhere, cells[("fedavg", 1)], [0.4, 0.5], device="cuda", **{"num-partitions": 0})
    fake_run(elsewhere, cells[("rs", 0)], [0.7, 0.8])  # on the CPU: not what the file says
    fake_run(suite, cells[("rs", 1)], [0.1, 0.2], device="cuda")  # in the suite's folder: not read
    folder = tmp_path / "results"
    with pytest.warns(UserWarning, match="computed under another config"):
        path = export_suite(
            suite, "suites/t.yaml", app_defaults(), folder, runs=runs, overrides={"device": "cuda"}, name="t-cuda"
        )
    rs = load_results(path)
    assert path.name == "t-cuda.yaml" and rs.name == "t-cuda" and rs.overrides == {"device": "cuda"}
    assert [(c.method, c.seeds) for c in rs.cells] == [("fedavg", [0, 1])]
    assert rs.cells[0].config["device"] == "cuda" and rs.cells[0].stats["global.final"].per_seed == [60.0, 50.0]
    assert not (folder / "t.yaml").exists()


def test_export_writes_only_the_chosen_cells_and_keeps_the_others(tmp_path: Path) -> None:
    """`fedskew experiment --export --methods fedavg`: a cell not chosen (rs, one seed finished of a
    run under way) is not written, and what the file held for it stays."""
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    cells = {(c.method, c.seed): c for c in suite.cells}
    for key in [("fedavg", 0), ("fedavg", 1), ("rs", 0)]:
        fake_run(suite, cells[key], [0.5, 0.6, 0.7])
    folder = tmp_path / "results"
    folder.mkdir()
    kept = CellResult("iid", "rs", [0, 1], {"global.last10": Stat(1.0)}, source="earlier")
    dump_results(ResultSet("t", "t", "suites/t.yaml", [kept]), folder / "t.yaml")
    chosen = select(suite, ["fedavg"])
    assert select(suite, cells=["iid/fedavg"]) == chosen  # `--cells partition/method`: the same cells
    with pytest.raises(ConfigError, match="no cell 'iid/fedavgg'"):
        select(suite, cells=["iid/fedavgg"])
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), folder, cells=chosen))
    assert [(c.method, c.seeds, c.source) for c in rs.cells][1] == ("rs", [0, 1], "earlier")
    assert (rs.cells[0].method, rs.cells[0].seeds) == ("fedavg", [0, 1])


def test_export_upto_takes_every_runs_first_rounds_stopped_part_way_included(tmp_path: Path) -> None:
    """Runs of a lent machine cut at its deadline: `upto` R exports the first R rounds of every run
    that reached R (finished or not), and only those; without it, unfinished runs are not read."""
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    cells = {(c.method, c.seed): c for c in suite.cells}
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])  # finished
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5])  # stopped after round 2
    (suite.folder / cells[("fedavg", 1)].run_name / "summary.json").unlink()
    fake_run(suite, cells[("rs", 0)], [0.9])  # stopped after round 1
    (suite.folder / cells[("rs", 0)].run_name / "summary.json").unlink()
    with pytest.warns(UserWarning, match="not exported, 1 of the first 2 rounds"):
        rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "r", upto=2))
    [fedavg] = rs.cells
    assert fedavg.seeds == [0, 1] and fedavg.rounds == 2 and "their first 2 rounds" in fedavg.source
    assert fedavg.stats["global.last10"].per_seed == [55.0, 45.0]  # rounds 1-2 only
    assert fedavg.stats["global.final"].per_seed == [60.0, 50.0]
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "r2"))
    assert [(c.method, c.seeds, c.rounds) for c in rs.cells] == [("fedavg", [0], 3)]


def test_export_leaves_out_a_resumed_run_of_a_method_whose_clients_keep_state(tmp_path: Path) -> None:
    """A resumed run's clients restarted without their state: for SCAFFOLD (c_i) the run is not the
    uninterrupted one and is left out, named; a resumed FedAvg run is. Older runs carry the resume
    only in the reason of an `aside-*/` folder; a start afresh (`overwrite`) after it clears it."""
    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(
        SUITE.format(out=tmp_path / "out").replace("  rs: {method: fedrs, fedrs-alpha: 0.5}", "  scaffold: {}")
    )
    suite = load_suite(suite_path, app_defaults())
    cells = {(c.method, c.seed): c for c in suite.cells}
    for key in cells:
        fake_run(suite, cells[key], [0.5, 0.6, 0.7])
    for method in ("fedavg", "scaffold"):
        (suite.folder / cells[(method, 0)].run_name / "timings.jsonl").write_text('{"round": 3, "resumed-after": 2}\n')
    edited = suite.folder / cells[("scaffold", 0)].run_name / "timings.jsonl"
    assert resumed_rounds(edited.parent) == [2]
    edited.write_text('{"round": 3, "resumed-after": "x"}\n')  # not a round: still resumed, not a crash
    assert resumed_rounds(edited.parent) == [0]
    edited.write_text('{"round": 3, "resumed-after": 2}\n')
    legacy = suite.folder / cells[("scaffold", 1)].run_name
    (legacy / "aside-20261101-000000-a").mkdir()
    (legacy / "aside-20261101-000000-a" / "reason.txt").write_text("resume after round 1: the files as they were\n")
    with pytest.warns(UserWarning) as caught:
        rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert [(c.method, c.seeds) for c in rs.cells] == [("fedavg", [0, 1])]
    said = sorted(str(w.message) for w in caught)
    assert len(said) == 2 and "resumed after round 2: scaffold's clients keep the control variate c_i" in said[0]
    assert "resumed after round 1" in said[1]
    (legacy / "aside-20261102-000000-b").mkdir()  # later: the run started afresh in its folder
    (legacy / "aside-20261102-000000-b" / "reason.txt").write_text("overwrite=true: a new run started afresh\n")
    os.utime(legacy / "aside-20261102-000000-b" / "reason.txt", (2e9, 2e9))
    with pytest.warns(UserWarning, match="resumed after round 2"):
        rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert [(c.method, c.seeds) for c in rs.cells] == [("fedavg", [0, 1]), ("scaffold", [1])]


def test_a_gain_whose_interval_alone_excludes_0_is_bold_but_unmarked_where_holm_drops_it() -> None:
    """Gains over FedAvg of +2 +- 0.1 (p ~ 2e-4) and of 1, 2, 0.5, 2.5 (mean 1.5, sd 0.91: t = 3.29 on 3
    degrees of freedom, p = 0.046): both intervals exclude 0, but with 2 comparisons Holm asks the
    larger p to be at most 0.05 / 1 after the first is rejected at 0.05 / 2: both kept; with a third,
    null method (p ~ 1) the second threshold stays 0.05 / 2 = 0.025 < 0.046: only the first is marked."""
    suite = yaml.safe_load((ROOT / "suites" / "leaderboard.yaml").read_text())
    base = [60.0, 50.0, 70.0, 65.0]

    def cell(method: str, gains: list[float]) -> CellResult:
        values = [b + g for b, g in zip(base, gains, strict=True)]
        return CellResult("c2", method, [0, 1, 2, 3], {"global.last10": Stat(float(np.mean(values)), 0.0, values)})

    strong, weak = cell("fedrs", [2.1, 1.9, 2.0, 2.0]), cell("fedmmd", [1.0, 2.0, 0.5, 2.5])
    two = Board(suite, ResultSet("leaderboard", "leaderboard", "", [cell("fedavg", [0.0] * 4), strong, weak]))
    assert two.gain("c2", "fedmmd").excludes_zero() and two.holm_kept("c2") == {"fedrs", "fedmmd"}
    null = cell("moon", [1.0, -1.0, 0.5, -0.5])
    no_global = CellResult("c2", "fedproto", [0, 1, 2, 3], {"personalized.last10": Stat(90.0, 0.5)})
    cells = [cell("fedavg", [0.0] * 4), strong, weak, null, no_global]
    three = Board(suite, ResultSet("leaderboard", "leaderboard", "", cells))
    assert three.holm_kept("c2") == {"fedrs"}
    page = leaderboard_md(Path("suites/leaderboard.yaml"), three, ROOT)
    assert "| fedproto | - | - | no global model | - |" in page and "| fedrep | - | - | - | - |" in page
    assert three.no_global("c2", "fedproto") and not three.no_global("c2", "fedrep")  # fedrep: not run
    assert not three.no_global("c2", "fedrs")
    assert "| fedrs | - | - | **+2.0 [+1.9, +2.1]**† |" in page
    assert "| fedmmd | - | - | **+1.5 [+0.0, +3.0]** |" in page
    assert "With 3 intervals a setting at 95%, 0.15 of them are expected to exclude 0 by chance alone" in page
    assert "under Holm's correction 1 (fedrs) above and 0 below" in leaderboard_verdict(three)


def test_leaderboard_pages_give_paired_gains_with_intervals_and_the_seed_counts() -> None:
    suite = yaml.safe_load((ROOT / "suites" / "leaderboard.yaml").read_text())
    empty = leaderboard_md(Path("suites/leaderboard.yaml"), Board(suite, None), ROOT)
    assert "**Not run yet.**" in empty and "| mupfl | lt10 | 0 | n/a | n/a | n/a | n/a |" in empty

    def cell(method: str, values: list[float], **more: Stat) -> CellResult:
        stat = Stat(float(np.mean(values)), float(np.std(values)), values)
        return CellResult("c2", method, [0, 1, 2, 3], {"global.last10": stat, **more})

    base = [60.0, 50.0, 70.0, 65.0]  # the seeds move FedAvg by 20 points ...
    cells = [
        cell("fedavg", base, **{"personalized.last10": Stat(90.0, 0.5)}),
        cell("fedrs", [v + 2.0 + e for v, e in zip(base, (0.1, -0.1, 0.2, -0.2), strict=True)]),  # ... +2 each
        cell("moon", [v + d for v, d in zip(base, (3.0, -3.0, 4.0, -4.0), strict=True)]),  # level, noisy
        cell("fedlc", [v - 1.0 for v in base]),
        cell("fedprox", [v + 0.5 for v in base]),
    ]
    board = Board(suite, ResultSet("leaderboard", "leaderboard", "", cells))
    assert board.gain("c2", "fedrs").excludes_zero()  # paired: +2 +- 0.3, where the stds are 7.4
    assert not board.gain("c2", "moon").excludes_zero()
    md = leaderboard_md(Path("suites/leaderboard.yaml"), board, ROOT)
    assert "| fedrs | - | - | **+2.0 [+1.7, +2.3]**† | " in md and "c2 (4 seeds)" in md
    assert "| fedavg | c2 | 4 | 61.25 ± 7.40 | n/a | n/a | 90.00 ± 0.50 |" in md
    # the seeds section: paired sds 0 (FedLC, FedProx), 0.18 (FedRS), 4.1 (MOON): median 0.09
    assert Board({"partitions": {"x": {}}}, None).planned("x") == 1  # a suite without seeds runs seed 0
    c2_planned = len(suite["partitions"]["c2"].get("seeds") or suite["seeds"])
    assert f"| c2 | 4 | {c2_planned} | 0.09 | 0.15 | 2 | 2 |" in md  # t(3) 3.18 x 0.091 / 2
    assert "at today's spread they cover the column for +-2 in every setting." in md
    one = {**suite, "partitions": {**suite["partitions"], "c2": {**suite["partitions"]["c2"], "seeds": [0]}}}
    short = leaderboard_md(Path("suites/leaderboard.yaml"), Board(one, board.results), ROOT)
    assert "| c2 | 4 | 1 | 0.09 |" in short and "fall short of the column for +-2 in c2 1 of 2." in short
    verdict = leaderboard_verdict(board)
    assert verdict.startswith(
        "**c2** (4 seeds): 2 of 4 methods above FedAvg (fedprox, fedrs), 1 below; "
        "under Holm's correction 2 (fedprox, fedrs) above and 1 (fedlc) below"
    )
    chance = board.top_chance("c2")
    assert chance["fedrs"] == 1.0 and chance["fedlc"] < 0.5  # always above FedAvg, fedlc always below it
    # a seed only some cells have reached (FedAvg and FedLC, where it would make FedLC first): every
    # method still ranks, on the seeds all of them hold
    ahead = [
        replace(
            c, seeds=[0, 1, 2, 3, 4], stats={"global.last10": Stat(0.0, 0.0, [*c.stats["global.last10"].per_seed, v])}
        )
        for c, v in zip(cells[:1] + cells[3:4], (0.0, 99.0), strict=True)
    ]
    partial = Board(
        suite, ResultSet("leaderboard", "leaderboard", "", [ahead[0], cells[1], cells[2], ahead[1], cells[4]])
    )
    assert partial.top_chance("c2") == chance and set(chance) == {"fedavg", "fedrs", "moon", "fedlc", "fedprox"}
    headline = "\n".join(leaderboard_headline(board))
    assert "| fedrs | - | **+2.0 [+1.7, +2.3]**† | - | n/a |" in headline and "c2 4" in headline
    assert leaderboard_verdict(Board(suite, None)) == ""
    assert "## Budget: 40 rounds against a converged budget" in md and "**Not run yet.** At 40 rounds" in md

    # a converged budget that reverses two methods' order: its gains beside the short budget's
    long_suite = {**suite, "base": {**suite["base"], "num-server-rounds": 200}}
    at_200 = {"fedavg": 0.0, "fedrs": 1.0, "moon": 3.0, "fedlc": 2.0, "fedprox": 4.0}
    long_cells = [cell(m, [v + d for v in base]) for m, d in at_200.items()]
    long = Board(long_suite, ResultSet("leaderboard-converged", "leaderboard-converged", "", long_cells))
    section = "\n".join(budget_section(board, long))
    # the short budget's means rank fedrs > moon > fedprox > fedavg > fedlc; the long one another way
    short = [board.values("c2", m) for m in at_200]
    rho = rank_correlation([np.mean(list(v.values())) for v in short], [np.mean(base) + d for d in at_200.values()])
    assert f"**c2**: rank correlation {rho:.2f} over 5 methods (4 and 4 seeds)." in section
    assert "| fedlc | **-1.0 [-1.0, -1.0]** | **+2.0 [+2.0, +2.0]** |" in section, section
    assert "| method | gain at 40 | gain at 200 |" in section and "| fedavg |" not in section


def test_before_the_converged_budget_the_page_gives_a_first_look_at_the_long_runs_on_their_seeds() -> None:
    """The convergence runs (seed 1 only, 300 rounds) beside the short budget on seed 1: gains on that
    seed alone (no interval), the rank correlation of the last-10 means between the budgets, and the
    methods above FedAvg at 40 rounds but below it at 300 named in README's line."""
    suite = yaml.safe_load((ROOT / "suites" / "leaderboard.yaml").read_text())

    def cell(method: str, seeds: list[int], values: list[float], best: list[float], rounds: int) -> CellResult:
        stats = {"global.last10": Stat(float(np.mean(values)), 0.0, values), "global.best": Stat(0.0, 0.0, best)}
        return CellResult("c2", method, seeds, stats, rounds=rounds)

    short = Board(
        suite,
        ResultSet(
            "leaderboard",
            "leaderboard",
            "",
            [  # seed 1 is the one the long runs share: fedavg 50, fedrs 55, moon 45, fedlc 52
                cell("fedavg", [0, 1, 2], [60.0, 50.0, 70.0], [70.0, 60.0, 75.0], 40),
                cell("fedrs", [0, 1, 2], [61.0, 55.0, 72.0], [70.0, 62.0, 75.0], 40),
                cell("moon", [0, 1, 2], [59.0, 45.0, 69.0], [70.0, 58.0, 75.0], 40),
                cell("fedlc", [0, 1, 2], [60.0, 52.0, 70.0], [70.0, 61.0, 75.0], 40),
            ],
        ),
    )
    runs_suite = {"methods": {"fedavg": {}, "fedrs": {}, "moon": {}, "fedlc": {}}, "partitions": {"c2": {}}}
    at_300 = [  # fedavg 80 > fedlc 79 > fedrs 70 > moon 60: fedrs and fedlc fall below FedAvg
        cell("fedavg", [1], [80.0], [85.0], 300),
        cell("fedrs", [1], [70.0], [84.0], 300),
        cell("moon", [1], [60.0], [70.0], 300),
        cell("fedlc", [1], [79.0], [86.0], 300),
    ]
    runs = Board(runs_suite, ResultSet("leaderboard-long", "leaderboard-long", "", at_300))
    (look,) = looks(short, runs)
    rho = rank_correlation([50.0, 55.0, 45.0, 52.0], [80.0, 70.0, 60.0, 79.0])  # ranks 3,1,4,2 against 1,3,4,2
    assert (look.seeds, look.rounds, look.flipped) == ([1], 300, ["fedrs", "fedlc"]) and look.rho == rho
    assert abs(rho - 0.2) < 1e-12  # 1 - 6 (4 + 4 + 0 + 0) / (4 x 15)
    section = "\n".join(budget_section(short, None, runs))
    assert "**Not run yet.**" in section and "**A first look** from the convergence runs" in section
    assert "**c2**, seed 1: the rank correlation of the last-10 means between 40 and 300 rounds is 0.20" in section
    assert "| fedrs | +5.0 | -10.0 | +2.0 | -1.0 |" in section and "| fedavg |" not in section
    assert "| fedlc | +2.0 | -1.0 | +1.0 | +1.0 |" in section
    said = "\n".join(leaderboard_headline(short, runs))
    assert "c2 0.20 at 300 rounds (fedrs, fedlc there below FedAvg)" in said
    assert "These are gains at" not in "\n".join(leaderboard_headline(short))  # no long runs: no line
    assert looks(short, Board(runs_suite, None)) == []
    longer = [cell("fedavg", [1], [85.0], [86.0], 1000), *at_300[1:3], cell("fedlc", [1], [82.0], [86.0], 1000)]
    (look,) = looks(short, Board(runs_suite, ResultSet("leaderboard-long", "leaderboard-long", "", longer)))
    assert (look.methods, look.rounds) == (["fedavg", "fedlc"], 1000)  # fedrs, moon still at 300: left out
    assert look.rho_text == "n/a (fewer than 3 methods)"


def test_the_leaderboard_suite_runs_every_registered_method_on_three_settings() -> None:
    from fedskew.registry import METHODS

    suite = load_suite(ROOT / "suites" / "leaderboard.yaml", app_defaults())
    assert set(suite.method_labels) == set(METHODS)
    assert suite.partition_labels == ["dir01", "c2", "lt10"]
    for p in suite.partition_labels:  # at least 10 seeds a setting at the short budget, the same for every method
        cells = [c for c in suite.cells if c.partition == p]
        seeds = {m: sorted(c.seed for c in cells if c.method == m) for m in suite.method_labels}
        first = seeds[suite.method_labels[0]]
        assert first == list(range(len(first))) and len(first) >= 10 and all(v == first for v in seeds.values())


def test_the_converged_leaderboard_runs_the_leaderboard_s_methods_and_settings_at_another_budget() -> None:
    """`suites/leaderboard-converged.yaml` is the leaderboard at a longer budget: the same methods with
    the same keys, the same settings and protocol; only rounds, checkpoints and seeds may differ."""
    short = yaml.safe_load((ROOT / "suites" / "leaderboard.yaml").read_text())
    long = yaml.safe_load((ROOT / "suites" / "leaderboard-converged.yaml").read_text())
    assert long["methods"] == short["methods"]
    budget = {"num-server-rounds", "checkpoint-every", "seeds"}

    def setting(d: dict) -> dict:
        return {k: v for k, v in (d or {}).items() if k not in budget}

    assert setting(long["base"]) == setting(short["base"])
    assert {p: setting(d) for p, d in long["partitions"].items()} == {
        p: setting(d) for p, d in short["partitions"].items()
    }
    assert (long["num-supernodes"], long["last-rounds"]) == (short["num-supernodes"], short["last-rounds"])


def test_readme_is_short_and_reaches_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    # the verdicts, then one small table per paper protocol and per reading the papers leave open
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) < 400
    linked = set(re.findall(r"\]\((docs/[^)#]+)\)", readme))
    for doc in [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "notes").glob("*.md")]:
        assert doc.relative_to(ROOT).as_posix() in linked, f"README.md does not link {doc.relative_to(ROOT)}"


def test_every_claim_cites_existing_cells() -> None:
    """The committed claims resolve (generate raises ConfigError on a missing cell or statistic) and
    every result file loads."""
    assert load_all(ROOT / "results")
    generate(ROOT, figures=False)


def test_seeds_accumulate_across_sessions_from_the_committed_result_file(tmp_path: Path) -> None:
    """Session 1 runs and exports seed 0; its run folders are gone in session 2 (another machine):
    the plan skips seed 0 as recorded in the result file, seed 1 runs, and the export keeps seed 0's
    values beside seed 1's. A default that changes the cell's config (its hash) makes seed 0 run
    again, and an export without it replaces the recorded seeds with a warning."""
    from fedskew.run.experiments import plan_cells

    suite, cells = export_setup(tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")  # the app's defaults
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])
    export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results")
    shutil.rmtree(suite.folder)  # session 2: no run folders

    plans = {p.cell.run_name: p.action for p in plan_cells(suite, tmp_path, [cells[("fedavg", s)] for s in (0, 1)])}
    assert plans == {"iid--fedavg--s0": "recorded", "iid--fedavg--s1": "run"}
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5, 0.6])
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    fedavg = rs.cell("iid", "fedavg")
    assert fedavg.seeds == [0, 1] and fedavg.stats["global.last10"].per_seed == [60.0, 50.0]
    assert fedavg.stats["global.last10"].mean == 55.0 and "seeds [0] as recorded before" in fedavg.source

    # another default of the cell's own keys: another hash, so seed 0 is not skipped ...
    toml = (tmp_path / "pyproject.toml").read_text().replace("\nlr = 0.01\n", "\nlr = 0.02\n")
    assert "lr = 0.02" in toml
    (tmp_path / "pyproject.toml").write_text(toml)
    plans = {p.cell.run_name: p.action for p in plan_cells(suite, tmp_path, [cells[("fedavg", 0)]])}
    assert plans == {"iid--fedavg--s0": "run"}
    # ... and a run under it does not join the recorded seeds: they are replaced, with a warning
    shutil.rmtree(suite.folder)
    fake_run(suite, cells[("fedavg", 0)], [0.9, 0.9, 0.9], lr=0.02)
    with pytest.warns(UserWarning, match=r"seeds \[1\] were recorded under another config"):
        rs = load_results(export_suite(suite, "suites/t.yaml", {**app_defaults(), "lr": 0.02}, tmp_path / "results"))
    assert rs.cell("iid", "fedavg").seeds == [0]


def test_a_seed_that_lacks_only_a_metric_added_since_is_recorded_not_run_again(tmp_path: Path) -> None:
    """Seed 0 ran before a metric existed (no personalized accuracy in its rows), seed 1 after: on a
    machine without their run folders both are 'recorded' (as their folders would be 'done'), seed 0's
    note names the metric it lacks, and the stat keeps its own seeds."""
    from fedskew.run.experiments import plan_cells

    suite, cells = export_setup(tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])
    metrics = suite.folder / cells[("fedavg", 0)].run_name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    older = [{k: v for k, v in r.items() if k != "personalized-accuracy"} for r in rows]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in older))
    export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results")
    shutil.rmtree(suite.folder)
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5, 0.6])
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    fedavg = rs.cell("iid", "fedavg")
    assert fedavg.seeds == [0, 1] and fedavg.stats["personalized.last10"].seeds == [1]
    assert fedavg.stats["global.last10"].seeds is None
    shutil.rmtree(suite.folder)

    plans = {p.cell.run_name: p for p in plan_cells(suite, tmp_path, [cells[("fedavg", s)] for s in (0, 1)])}
    assert [p.action for p in plans.values()] == ["recorded", "recorded"]
    assert "without personalized" in plans["iid--fedavg--s0"].note
    assert "without" not in plans["iid--fedavg--s1"].note


def test_the_hash_of_a_cell_ignores_other_methods_keys_and_neutral_defaults() -> None:
    from fedskew.reports.resultfile import config_sha256

    cfg = validate({**app_defaults(), "method": "fedavg"})
    assert config_sha256(cfg) == config_sha256({**cfg, "mupfl-tau": 3, "seed": 9, "out-dir": "/x"})
    assert config_sha256(cfg) == config_sha256({k: v for k, v in cfg.items() if k != "compute-dtype"})
    assert config_sha256(cfg) != config_sha256({**cfg, "compute-dtype": "float64"})
    assert config_sha256(cfg) != config_sha256({**cfg, "lr": 0.5})
    rs = validate({**app_defaults(), "method": "fedrs"})
    assert config_sha256(rs) != config_sha256({**rs, "fedrs-alpha": 0.9})  # its own key counts


def test_absurd_means_in_a_result_file_never_reach_a_table(tmp_path: Path) -> None:
    """Means of +-1e308 gave 300-digit README cells and an infinite gain: such a file is refused by
    `fedskew report` with one line naming it and the key, exit 2, nothing written."""
    from fedskew.reports.report import main

    root = copy_inputs(tmp_path)
    path = root / "results" / "paper-fedrs.yaml"
    path.write_text(path.read_text().replace("global.last50: {mean: 85.28,", "global.last50: {mean: 1.0e+308,", 1))
    peers = (root / "docs" / "notes" / "peers.md").read_text()
    assert main(["--root", str(root)]) == 2
    assert [p for p in root.glob("docs/**/*") if p.is_file()] == [root / "docs" / "notes" / "peers.md"]
    assert (root / "docs" / "notes" / "peers.md").read_text() == peers


HOSTILE = "a | b\n| c |\n<script>alert(1)</script> [x](javascript:alert(1)) &#60;img&#62;"


def test_text_from_files_is_shown_as_text_in_every_markdown_table(tmp_path: Path) -> None:
    """A claim, a row label, a reason, a paper note, a table's title and setting, a paper's title and
    notes link, the leaderboard's labels and a peer's setting, caption and gap reason holding `|`, line breaks,
    HTML and a `javascript:` link: each table keeps its columns and rows, no HTML tag or javascript
    link is left, and code spans and ordinary links are kept."""
    root = copy_inputs(tmp_path)
    claims = yaml.safe_load((root / "results" / "claims.yaml").read_text())
    paper = claims["papers"][0]
    paper.update(title=HOSTILE, claim=HOSTILE, notes="javascript:alert(1)")
    table = paper["tables"][0]
    table.update(title=HOSTILE, setting=HOSTILE)
    row = next(r for r in table["rows"] if r.get("claim"))
    row.update(row=HOSTILE, claim=HOSTILE, reason=HOSTILE + " `a|b <i>` [ok](notes/x.md)", **{"paper-note": HOSTILE})
    (root / "results" / "claims.yaml").write_text(yaml.safe_dump(claims))
    board = yaml.safe_load((root / "suites" / "leaderboard.yaml").read_text())
    board["methods"] = {HOSTILE if m == "fedprox" else m: v for m, v in board["methods"].items()}
    (root / "suites" / "leaderboard.yaml").write_text(
        "# a header line with ``` that would close its code block\n# <script>x</script>\n" + yaml.safe_dump(board)
    )
    published = yaml.safe_load((root / "results" / "peers" / "published.yaml").read_text())
    published["peers"]["niid-bench"]["settings"]["c2"] = HOSTILE
    published["peers"]["niid-bench"]["gaps"] = {"fedavg": {"c2": HOSTILE}}
    published["peers"]["niid-bench"]["beside"]["dir05"] = {"dir05-drawn": HOSTILE}  # a caption beside a number
    (root / "results" / "peers" / "published.yaml").write_text(yaml.safe_dump(published))
    files = generate(root, figures=False)
    assert HOSTILE.splitlines()[0] not in files[root / "docs" / "notes" / "peers.md"]  # escaped, not dropped:
    assert "a \\| b \\| c \\| &lt;script&gt;" in files[root / "docs" / "notes" / "peers.md"]
    for text in files.values():
        text = re.sub(r"\n(`{3,})text\n.*?\n\1\n", "\n", text, flags=re.S)  # a code block shows its text as it is
        assert "<script" not in text and "](javascript:" not in text and "&#60;" not in text
        for block in re.split(r"\n(?!\|)", text):  # every table: its rows as many columns as its header
            lines = [line for line in block.splitlines() if line.startswith("|")]
            widths = {len(re.split(r"(?<!\\)\|", line)) for line in lines}
            assert len(widths) <= 1, block[:500]
    results = files[root / "docs" / "results.md"]
    assert "a \\| b \\| c \\| &lt;script&gt;alert(1)&lt;/script&gt; [x]\\(javascript:alert(1))" in results
    assert "`a\\|b <i>` [ok](notes/x.md)" in results  # a code span as it is, an ordinary link kept
    assert "Long form: a \\| b" not in results and "Long form: javascript:alert(1)." in results
    leaderboard = files[root / "docs" / "leaderboard.md"]
    assert "````text\na header line with ``` that would close its code block" in leaderboard


def test_an_export_records_the_device_and_keeps_revisions_apart(tmp_path: Path) -> None:
    """The runs' summaries name their device (`device="auto"` resolved), processor and method's
    revision: the cell records the devices and each seed's processor (a name that is not printable
    text is left out), and a run of another revision does not join the recorded seeds."""
    suite, cells = export_setup(tmp_path)
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])
    summary = suite.folder / cells[("fedavg", 0)].run_name / "summary.json"
    summary.write_text(json.dumps({"method-revision": 0, "device": "cuda", "wall_seconds": 12.5, "processor": "H100"}))
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert rs.cell("iid", "fedavg").device == "cuda" and rs.cell("iid", "fedavg").processor == {0: "H100"}
    shutil.rmtree(suite.folder)
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5, 0.6])
    summary = suite.folder / cells[("fedavg", 1)].run_name / "summary.json"
    summary.write_text(json.dumps({"method-revision": 0, "device": "cpu", "processor": "cpu\x1b[2J"}))
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert rs.cell("iid", "fedavg").seeds == [0, 1] and rs.cell("iid", "fedavg").device == "cpu, cuda"
    assert rs.cell("iid", "fedavg").processor == {0: "H100"}  # seed 0's kept; seed 1's name is not printable
    assert rs.cell("iid", "fedavg").wall_seconds == {0: 12.5}  # seed 0's as recorded; seed 1's summary has none
    summary.write_text(json.dumps({"method-revision": 7, "device": "cpu"}))  # the method's arithmetic changed
    with pytest.warns(UserWarning, match=r"seeds \[0\] were recorded under another config"):
        rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert rs.cell("iid", "fedavg").seeds == [1]


def test_a_resumed_runs_wall_time_counts_the_rounds_its_earlier_processes_ran(tmp_path: Path) -> None:
    """`summary.json`'s `wall_seconds` is the last process's: the export adds the `seconds` that
    `timings.jsonl` records for the rounds kept from earlier processes (up to the last resume's round;
    a value that is not a finite, non-negative number counts 0), and no more for an unresumed run."""
    suite, cells = export_setup(tmp_path)
    for seed in (0, 1):
        fake_run(suite, cells[("fedavg", seed)], [0.5, 0.6, 0.7, 0.8])
    timings = [
        {"round": 1, "seconds": 10.0},  # the first process: rounds 1-2 kept
        {"round": 2, "seconds": float("nan")},  # an edited file: counts 0
        {"round": 3, "seconds": 100.0, "resumed-after": 2},  # the second process: rounds 3 (kept) and 4
        {"round": 4, "seconds": "x", "resumed-after": 3},  # the third process's, after a second resume
    ]
    run_dir = suite.folder / cells[("fedavg", 0)].run_name
    (run_dir / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timings))
    (suite.folder / cells[("fedavg", 1)].run_name / "timings.jsonl").write_text(json.dumps(timings[0]) + "\n")
    assert run_seconds(run_dir, 1.0) == 1.0 + 10.0 + 0.0 + 100.0
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    assert rs.cell("iid", "fedavg").wall_seconds == {0: 111.0, 1: 1.0}


def test_an_export_records_each_seeds_clipped_updates_and_the_page_counts_them(tmp_path: Path) -> None:
    """A run's rounds log `update-clipped` (replies clipped at `update-norm-bound`): the export sums
    them per seed (a run from before the bound logs none: its seed stays unknown, not 0), later
    exports keep the earlier seeds' counts, a hostile count is refused naming the key, and the
    leaderboard page says how many runs clipped."""
    from fedskew.reports.leaderboard import clipped_line

    suite, cells = export_setup(tmp_path)
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.5, 0.6])
    metrics = suite.folder / cells[("fedavg", 1)].run_name / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    rows = [{**json.loads(line), "update-clipped": n} for line, n in zip(lines, (0, 2, 1), strict=True)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"iid/fedavg: seeds \[1\] clipped updates"):
        path = export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results")
    assert load_results(path).cell("iid", "fedavg").clipped == {1: 3}
    shutil.rmtree(suite.folder)
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])  # from before the bound: no update-clipped
    rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results"))
    cell = rs.cell("iid", "fedavg")
    assert cell.seeds == [0, 1] and cell.clipped == {1: 3}  # seed 1's count kept, seed 0's unknown

    board = Board({"methods": {"fedavg": {}}, "partitions": {"iid": {}}, "seeds": [0, 1]}, rs)
    line = clipped_line(board)
    assert "iid: 1 of 1 runs, 3 updates (fedavg)" in line and "3 times its round's median norm" in line
    assert clipped_line(Board({"methods": {"fedavg": {}}, "partitions": {"iid": {}}}, None)) == ""

    path.write_text(path.read_text().replace("clipped-updates: {1: 3}", "clipped-updates: {1: -3}"))
    with pytest.raises(ConfigError, match=r"clipped-updates\[1\]=-3 is not allowed: must be a count of updates"):
        load_results(path)


def test_a_run_that_stopped_at_a_failed_round_is_exported_over_the_rounds_before(tmp_path: Path) -> None:
    """A run whose round no retry completed (a diverged model's every reply refused) leaves
    `stopped.json`: the export counts it with the rounds it ran and records where it stopped, rather
    than leaving the seed out (which would keep only the seeds that did not diverge); a stop file
    that does not describe the rows, or holds no round, is not trusted; the page names the stop."""
    from fedskew.reports.leaderboard import stopped_line

    suite, cells = export_setup(tmp_path)
    fake_run(suite, cells[("fedavg", 0)], [0.5, 0.6, 0.7])
    stopped = suite.folder / cells[("fedavg", 1)].run_name
    fake_run(suite, cells[("fedavg", 1)], [0.4, 0.1])
    (stopped / "summary.json").unlink()
    (stopped / "stopped.json").write_text(json.dumps({"round": 3, "reason": "round 3: only 0 usable replies"}))
    with pytest.warns(UserWarning, match="stopped at round 3: exported over the rounds before"):
        path = export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results")
    cell = load_results(path).cell("iid", "fedavg")
    assert cell.seeds == [0, 1] and cell.rounds == 3 and cell.stopped == {1: 3} and cell.config_sha256
    assert cell.stats["global.best"].per_seed == [70.0, 40.0] and cell.stats["global.final"].per_seed == [70.0, 10.0]
    assert "stopped-at-round: {1: 3}" in path.read_text()

    board = Board({"methods": {"fedavg": {}}, "partitions": {"iid": {}}, "seeds": [0, 1]}, load_results(path))
    assert "iid/fedavg: seed 1 stopped at round 3" in stopped_line(board)
    assert stopped_line(Board({"methods": {"fedavg": {}}, "partitions": {"iid": {}}}, None)) == ""

    bad_stops = (({"round": 4}, "stopped.json says round 4 but metrics.jsonl holds 2"), ({"round": "3"}, None))
    for bad, why in bad_stops:
        (stopped / "stopped.json").write_text(json.dumps(bad))
        (out := tmp_path / f"results-{bad['round']}").mkdir()
        if why:
            with pytest.warns(UserWarning, match=why):
                rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), out))
        else:  # no round: as a run killed part-way, not read
            rs = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), out))
        assert rs.cell("iid", "fedavg").seeds == [0]

    path.write_text(path.read_text().replace("stopped-at-round: {1: 3}", "stopped-at-round: {1: 4}"))
    with pytest.raises(ConfigError, match=r"stopped-at-round\[1\]=4 is not allowed: must be a round"):
        load_results(path)


def test_a_finished_run_of_an_earlier_revision_of_its_method_is_changed_not_done(tmp_path: Path) -> None:
    """A method's arithmetic fixed since a cell ran (`MethodSpec.revision`): the plan does not skip
    the cell as done, it says which revision ran (and `--rerun-changed` runs it again)."""
    from fedskew.registry import METHODS
    from fedskew.run.experiments import plan_cells

    suite_path = tmp_path / "t.yaml"
    suite_path.write_text(SUITE.replace("fedavg: {{}}", "scaffold: {{}}").format(out=tmp_path / "out"))
    suite = load_suite(suite_path, app_defaults())
    cell = next(c for c in suite.cells if c.method == "scaffold" and c.seed == 0)
    fake_run(suite, cell, [0.5, 0.6, 0.7])
    assert METHODS["scaffold"].revision >= 1
    (plan,) = plan_cells(suite, ROOT, [cell])  # its summary names no revision: revision 0
    assert plan.action == "changed" and f"scaffold revision 0, now {METHODS['scaffold'].revision}" in plan.note
    (plan,) = plan_cells(suite, ROOT, [cell], rerun_changed=True)
    assert plan.action == "rerun"
    (suite.folder / cell.run_name / "summary.json").write_text(
        json.dumps({"method-revision": METHODS["scaffold"].revision})
    )
    assert [p.action for p in plan_cells(suite, ROOT, [cell])] == ["done"]


def test_the_leaderboard_says_where_each_setting_ran_and_how_long() -> None:
    from fedskew.reports.leaderboard import where_ran

    stat = {"global.last10": Stat(50.0)}
    cells = [
        CellResult("a", "fedavg", [0, 1], stat, device="cpu", wall_seconds={0: 1800.0, 1: 1800.0}),
        CellResult("a", "fedrs", [0, 1], stat, device="cuda", wall_seconds={0: 3600.0}),
        CellResult("b", "fedavg", [0], stat, device="cpu"),
    ]
    suite = {"methods": {"fedavg": {}, "fedrs": {}}, "partitions": {"a": {}, "b": {}}}
    board = Board(suite, ResultSet("x", "s", "suites/s.yaml", cells))
    assert where_ran(board) == (
        "Where the cells ran and how long (the wall time of their runs, summed; the queue runs two at once), "
        "as their result file records: a cpu, cuda, 2.0 h over the 3 of 4 runs timed; b cpu."
    )
    assert where_ran(Board(suite, ResultSet("x", "s", "s.yaml", [CellResult("b", "fedavg", [0], stat)]))) == ""
    hostile = [CellResult("b", "fedavg", [0], stat, device="<img src=x onerror=alert(1)>")]  # text from disk
    assert "<img" not in where_ran(Board(suite, ResultSet("x", "s", "s.yaml", hostile)))


def test_a_long_processor_name_is_cut_to_what_a_result_file_keeps(monkeypatch) -> None:
    """A CPU model of 200 characters plus torch's kernel suffix is cut to 200, so the export keeps it."""
    import torch

    from fedskew import training
    from fedskew.reports.resultfile import processor_text

    monkeypatch.setattr(training, "processor_name", lambda: "x" * 200)
    name = training.processor(torch.device("cpu"))
    assert name == "x" * 200 and processor_text(name) == name


def test_the_leaderboard_names_each_settings_processors_and_where_fedavgs_twin_parts_from_it() -> None:
    """Setting a: seed 1's two cells ran on two processors (named as mixed), and Ditto, FedAvg's twin,
    differs there (two processors) but not on seed 0; setting b records no processor, and its twin
    gap on seed 0 says so. Without processors or gaps the line is empty."""
    from fedskew.reports.leaderboard import processors_line

    def cell(p: str, m: str, values: list[float], ran: dict[int, str]) -> CellResult:
        seeds = list(range(len(values)))
        return CellResult(p, m, seeds, {"global.last10": Stat(50.0, None, values)}, processor=ran)

    amd, intel = "AMD EPYC (AVX2)", "Intel Xeon (AVX512)"
    cells = [
        cell("a", "fedavg", [50.0, 60.0], {0: intel, 1: amd}),
        cell("a", "ditto", [50.0, 61.5], {0: intel, 1: intel}),
        cell("b", "fedavg", [40.0], {}),
        cell("b", "ditto", [39.0], {}),
    ]
    suite = {
        "methods": {"fedavg": {}, "ditto": {}},
        "partitions": {"a": {}, "b": {}},
        "base": {"num-server-rounds": 40},
    }
    text = processors_line(Board(suite, ResultSet("x", "s", "suites/s.yaml", cells)))
    assert (
        f"a: {amd} 1 run, {intel} 3 runs, 0 not recorded. Seeds whose recorded runs span processors: a seed 1." in text
    )
    assert "they differ on a seed 1 (+1.50, two), b seed 0 (-1.00, processors not recorded)" in text
    assert "a seed 0" not in text.split("differ on")[1] and "40 rounds amplify" in text
    same = [cell("a", "fedavg", [50.0], {0: intel}), cell("a", "ditto", [50.5], {0: intel})]
    assert "a seed 0 (+0.50, one processor)" in processors_line(Board(suite, ResultSet("x", "s", "s.yaml", same)))
    equal = [cell("a", "fedavg", [50.0], {}), cell("a", "ditto", [50.0], {})]
    assert processors_line(Board(suite, ResultSet("x", "s", "s.yaml", equal))) == ""
