"""The generated reports: the committed docs are what the committed result files give, an edited
number changes them, result files are checked when read, a suite's runs export into them."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from fedskew.config import ConfigError, validate
from fedskew.experiments import load_suite, select
from fedskew.report import (
    Evidence,
    Numbers,
    Row,
    generate,
    leaderboard_headline,
    leaderboard_md,
    leaderboard_verdict,
    numbers,
    render_reason,
    shown_verdict,
    spread_of_gain,
)
from fedskew.resultfile import CellResult, ResultSet, Stat, dump_results, export_suite, load_all, load_results
from fedskew.server_app.results import resumed_rounds, saved_config
from tests.harness import ROOT, app_defaults

GENERATED = ("docs/results.md", "docs/leaderboard.md", "README.md")


def copy_inputs(tmp_path: Path) -> Path:
    """What `fedskew report` reads, copied: results/, the leaderboard suite, README.md."""
    shutil.copytree(ROOT / "results", tmp_path / "results")
    (tmp_path / "suites").mkdir()
    shutil.copy(ROOT / "suites" / "leaderboard.yaml", tmp_path / "suites")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_committed_docs_are_what_the_committed_results_give() -> None:
    """`fedskew report` run on the committed results/ rewrites nothing: text and numbers agree."""
    files = generate(ROOT, figures=False)
    for name in GENERATED:
        assert files[ROOT / name] == (ROOT / name).read_text(), f"{name} is stale: run `fedskew report`"


def test_editing_a_committed_number_changes_the_docs(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    before = generate(root, figures=False)[root / "docs" / "results.md"]
    assert "| C10-100-2 FedRS (alpha 0.5) | 70.8 (+14.9) | 85.28 ± 0.43 (+8.0) | **holds** |" in before
    path = root / "results" / "paper-fedrs.yaml"
    text = path.read_text()
    old = "- partition: c10-100-2\n  method: fedrs-0.5\n"
    start = text.index(old)
    cell = text[start:].split("\n- partition:")[0]
    assert "global.last50: {mean: 85.28, std: 0.43}" in cell
    path.write_text(text[:start] + cell.replace("mean: 85.28,", "mean: 75.28,") + text[start + len(cell) :])
    after = generate(root, figures=False)
    results, readme = after[root / "docs" / "results.md"], after[root / "README.md"]
    assert "| C10-100-2 FedRS (alpha 0.5) | 70.8 (+14.9) | 75.28 ± 0.43 (-2.0) |" in results
    # a "holds" whose gain now has the other sign than the paper's is flagged for re-judging
    assert "(re-judge: our gain has the other sign)" in results and "re-judge" not in before
    assert "-2.0 ± 1.1" in readme  # the headline table follows too


def test_only_a_flip_outside_the_seeds_spread_is_flagged_for_re_judging() -> None:
    """A "level" claim (the paper -0.4, ours +0.2 +- 0.9) has no established sign: not flagged; the
    same gain with a spread of 0.1, or without one, is."""
    row = Row("level", "f/p/m", "global.last10", paper=66.9, vs="f/p/b", vs_paper=67.3, verdict="holds")
    for spread, flagged in ((0.9, False), (0.1, True), (None, True)):
        nums = Numbers(Stat(67.0), Stat(66.8), 0.2, spread, -0.4)
        assert ("re-judge" in shown_verdict(row, nums)) is flagged, spread
    assert shown_verdict(row, Numbers(Stat(67.0), Stat(66.8), -0.2, 0.1, -0.4)) == "**holds**"


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
    assert nums.gain == 10.0 and nums.spread == pytest.approx(5**0.5)  # stds combined: no per-seed values
    assert render_reason(row, nums, ev) == "+10.0; 4.0x; 80.00"
    with pytest.raises(ConfigError, match=r"no statistic 'global\.best'"):
        numbers(Row("x", "f/p/a", "global.best"), ev)
    with pytest.raises(ConfigError, match="no result cell 'f/p/c'"):
        ev.cell("f/p/c")


def test_the_spread_of_a_gain_pairs_seeds_when_both_kept_them() -> None:
    a, b = Stat(2.0, 0.8, [1.0, 2.0, 3.0]), Stat(1.0, 0.8, [0.0, 1.0, 2.0])
    assert spread_of_gain(a, b, [0, 1, 2], [0, 1, 2]) == 0.0  # the same gain on every seed
    assert spread_of_gain(a, b, [0, 1, 2], [1, 2, 3]) == pytest.approx(0.8 * 2**0.5)  # other seeds: combined
    assert spread_of_gain(Stat(1.0), b, [0], [0]) is None


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c["stats"].update({"global.last10": {"mean": float("nan")}}), "global.last10.mean=nan"),
        (lambda c: c["stats"].update({"global.lastten": {"mean": 1.0}}), "'global.lastten' is not allowed"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "per-seed": [1.0]}}), "a list of 2 numbers"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "std": -1}}), "must be a finite number >= 0"),
        (lambda c: c["stats"].update({"global.last10": {"mean": 1.0, "sd": 1}}), "unknown key 'sd'"),
        (lambda c: c.update({"seeds": [0, 0]}), "distinct integers"),
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


def test_leaderboard_reads_balanced_and_worst_class_when_present(tmp_path: Path) -> None:
    suite = yaml.safe_load((ROOT / "suites" / "leaderboard.yaml").read_text())
    empty = leaderboard_md(Path("suites/leaderboard.yaml"), suite, None)
    assert "**Not run yet.**" in empty and "| mupfl | lt10 | n/a | n/a | n/a | n/a |" in empty
    stats = {"global.last10": Stat(60.0, 1.0), "personalized.last10": Stat(90.0, 0.5)}
    cells = [
        CellResult("c2", "fedavg", [0, 1, 2], dict(stats)),
        CellResult(
            "c2", "fedrs", [0, 1, 2], {**stats, "global.last10": Stat(70.0, 1.0), "balanced.last10": Stat(69.0, 1.0)}
        ),
    ]
    md = leaderboard_md(Path("suites/leaderboard.yaml"), suite, ResultSet("leaderboard", "leaderboard", "", cells))
    assert "| fedrs | c2 | 70.00 ± 1.00 | 69.00 ± 1.00 | n/a | 90.00 ± 0.50 |" in md
    assert "| fedrs | n/a | 70.00 ± 1.00 (+10.0) | n/a |" in md  # the gain over FedAvg on that setting
    assert "Not run yet" not in md
    # the verdict line: the best method per setting, and who beats FedAvg by more than both spreads
    cells.append(CellResult("c2", "moon", [0, 1, 2], {**stats, "global.last10": Stat(61.5, 1.0)}))
    results = ResultSet("leaderboard", "leaderboard", "", cells)
    assert leaderboard_verdict(suite, results) == (
        "Best global accuracy over FedAvg per setting (c2: fedrs +10.0, 1 of 2 above FedAvg beyond the seeds' spread)."
    )
    assert leaderboard_verdict(suite, None) == ""
    # README's headline: the personalized mean only once every setting has it
    assert "| fedrs | n/a | 70.00 | n/a | +10.0 | n/a |" in leaderboard_headline(suite, results)
    full = [CellResult(p, "fedrs", [0], {"personalized.last10": Stat(v)}) for p, v in (("dir01", 80), ("lt10", 70))]
    headline = leaderboard_headline(suite, ResultSet("leaderboard", "leaderboard", "", [*cells, *full]))
    assert "| fedrs | n/a | 70.00 | n/a | +10.0 | 80.00 |" in headline  # (80 + 90 + 70) / 3


def test_the_leaderboard_suite_runs_every_registered_method_on_three_settings() -> None:
    from fedskew.registry import METHODS

    suite = load_suite(ROOT / "suites" / "leaderboard.yaml", app_defaults())
    assert set(suite.method_labels) == set(METHODS)
    assert suite.partition_labels == ["dir01", "c2", "lt10"] and sorted({c.seed for c in suite.cells}) == [0, 1, 2]


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
