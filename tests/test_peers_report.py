"""The peers' table (`fedskew.reports.peers`): their numbers beside ours, the gap's interval, the reasons."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from fedskew.config import ConfigError
from fedskew.reports.peers import PUBLISHED, cost_line, gap_text, load_rows, peers_table
from fedskew.reports.resultfile import CellResult, ResultSet, Stat
from tests.harness import ROOT


def _published(tmp: Path, gaps: dict | None = None) -> Path:
    peer = {
        "suite": "suites/peer-x.yaml",
        "settings": {"a": "Setting A", "b": "Setting B"},
        "rows": {
            "fedavg": {"a": {"mean": 80.0, "std": 1.0}, "b": {"mean": 70.0, "std": 1.0}},
            "fedrs": {"a": {"mean": 90.0, "std": 0.5}},
        },
        "ours": {"fedavg": "global.best", "fedrs": "global.best"},
        "runs": 3,
        "gaps": gaps or {},
    }
    path = tmp / PUBLISHED
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({"format": 1, "peers": {"x": peer}}))
    return path


def _cell(partition: str, method: str, values: list[float]) -> CellResult:
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5  # population std, as result files keep it
    return CellResult(partition, method, list(range(len(values))), {"global.best": Stat(mean, std, values)})


def test_rows_gaps_and_reasons(tmp_path: Path) -> None:
    _published(tmp_path)
    assert all(r.ours is None for r in load_rows(tmp_path, {}))  # the suite has not run
    table = peers_table(load_rows(tmp_path, {}))
    assert table[2] == "| x | Setting A | fedavg | 80.00 ± 1.00 | not run yet (`global.best`) |  |  |  |"
    assert [line.split(" | ")[1:3] for line in table[2:]] == [
        ["Setting A", "fedavg"],
        ["Setting A", "fedrs"],
        ["Setting B", "fedavg"],
    ]  # grouped by setting

    cells = [_cell("a", "fedavg", [79.0, 80.0, 81.0]), _cell("a", "fedrs", [80.0, 80.5, 81.0])]
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", cells)}
    rows = {(r.setting, r.method): r for r in load_rows(tmp_path, sets)}
    # ours 80 (sample sd 1, 3 seeds) against theirs 80 +- 1 over 3 runs: Welch's df 4, half-width
    # t(0.975, 4) sqrt(1/3 + 1/3) = 2.776 x 0.816 = 2.27
    level = rows["Setting A", "fedavg"].gap
    assert level is not None and level.mean == pytest.approx(0.0) and level.half == pytest.approx(2.2667, abs=1e-3)
    assert not level.excludes_zero()
    far = rows["Setting A", "fedrs"].gap  # ours 80.5 against theirs 90: far outside
    assert far is not None and far.high < 0
    table = peers_table(list(rows.values()))
    assert (
        "| x | Setting A | fedavg | 80.00 ± 1.00 | 80.00 ± 0.82 (`global.best`, 3) | +0.0 [-2.3, +2.3] |  |  |" in table
    )
    assert any("| fedrs |" in line and "**outside the spread: no reason written yet**" in line for line in table)

    # one seed: its std (0 in a result file) is no spread, so no ± and no interval, and the row says so
    one = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [_cell("a", "fedavg", [83.0])])}
    rows = load_rows(tmp_path, one)
    assert rows[0].gap is None
    assert peers_table(rows)[2] == (
        "| x | Setting A | fedavg | 80.00 ± 1.00 | 83.00 (`global.best`, 1) | +3.00 (one seed: no interval) |  |  |"
    )

    # a cell that ran, recorded without the row's statistic (a metric added since): said so, not "not run"
    other = _cell("a", "fedavg", [83.0, 84.0])
    other = replace(other, stats={"personalized.best": other.stats["global.best"]})
    rows = load_rows(tmp_path, {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [other])})
    assert rows[0].ours is None and rows[0].seeds == 2
    assert "| not measured by its 2 recorded seeds (`global.best`) |" in peers_table(rows)[2]

    reason = "their network, 582k parameters against LeNet's 44k"
    _published(tmp_path / "with-reason", {"fedrs": {"a": reason}})
    table = peers_table(load_rows(tmp_path / "with-reason", sets))
    assert any("| fedrs |" in line and line.endswith(f"| {reason} |") for line in table)


def test_the_cost_line_sums_the_recorded_wall_times_and_counts_the_untimed_runs(tmp_path: Path) -> None:
    """Runs of 40, 44 and 60 min (one more untimed) on the CPU: 2.4 h over 3 of 4 runs, a run 40-60 min
    (median 44); nothing timed: no line."""
    _published(tmp_path)
    walls = {0: 2400.0, 1: 2640.0, 2: 3600.0}
    timed = replace(_cell("a", "fedavg", [79.0, 80.0, 81.0]), device="cpu", wall_seconds=walls)
    other = replace(_cell("b", "fedavg", [70.0]), device="cpu")
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [timed, other])}
    line = cost_line(load_rows(tmp_path, sets), sets)
    assert line.endswith(": peer-x: cpu, 2.4 h over the 3 of 4 runs timed, a run 40-60 min (median 44)."), line
    bare = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [_cell("a", "fedavg", [80.0])])}
    assert cost_line(load_rows(tmp_path, bare), bare) == ""
    # a result file's device is text from disk: shown as text, not as the page's markup
    hostile = replace(timed, device="cpu, <script>x</script>")
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [hostile])}
    line = cost_line(load_rows(tmp_path, sets), sets)
    assert "<script>" not in line and "cpu, " in line, line


def test_the_settings_beside_a_row_stand_in_its_column_with_their_gaps(tmp_path: Path) -> None:
    """A peer's `beside` names, per setting, our other settings with a caption (a split drawn per seed,
    the peer's network): each one's number, seeds and gap to theirs, in the order written, not bold
    (only a row's own gap asks for a reason); a setting without one, or whose other cell has not run,
    leaves it empty."""
    path = _published(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["peers"]["x"]["beside"] = {"a": {"a-drawn": "a split drawn per seed", "a-net": "their network"}}
    path.write_text(yaml.safe_dump(raw))
    cells = [_cell("a", "fedavg", [80.0, 80.0]), _cell("a-drawn", "fedavg", [81.0, 83.0]), _cell("b", "fedavg", [70.0])]
    cells.append(_cell("a-net", "fedavg", [70.0]))
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", cells)}
    table = peers_table(load_rows(tmp_path, sets))
    drawn = "a split drawn per seed: 82.00 ± 1.00 (2), +2.0 [-4.0, +8.0]"
    assert table[2].endswith(f"| {drawn}; their network: 70.00 (1), -10.00 (one seed: no interval) |  |")
    assert table[3].endswith("|  |  |") and table[4].endswith("|  |  |")  # fedrs: neither other cell ran; b: none
    far = _cell("a-drawn", "fedavg", [95.0, 95.2])
    assert gap_text((80.0, 1.0, 3), far.stats["global.best"], 2) == "**+15.1 [+12.7, +17.5]**"
    assert gap_text((80.0, 1.0, 3), far.stats["global.best"], 2, mark=False) == "+15.1 [+12.7, +17.5]"
    raw["peers"]["x"]["beside"] = {"c": {"c-drawn": "drawn"}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"peers\.x\.beside=.* is not allowed: must map a setting label"):
        load_rows(tmp_path, {})
    raw["peers"]["x"]["beside"] = {"a": "a-drawn"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"peers\.x\.beside=.* is not allowed: must map a setting label"):
        load_rows(tmp_path, {})


def test_a_methods_variants_stand_beside_its_rows_in_every_setting(tmp_path: Path) -> None:
    """A peer's `variants` names, per method, other method labels of our suite (the method with a key
    changed) with a caption: in each setting where that cell ran, its number, seeds and gap to theirs
    stand beside ours, after the `beside` settings; a setting where it has not run leaves it out; a
    variant of a method the peer does not print, or one that is not a {label: caption} map, is refused."""
    path = _published(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["peers"]["x"]["beside"] = {"a": {"a-drawn": "drawn"}}
    raw["peers"]["x"]["variants"] = {"fedavg": {"fedavg-lr": "a lower lr"}}
    path.write_text(yaml.safe_dump(raw))
    cells = [_cell("a", "fedavg", [80.0, 80.0]), _cell("a-drawn", "fedavg", [81.0]), _cell("b", "fedavg", [70.0])]
    cells += [_cell("a", "fedavg-lr", [75.0, 77.0]), _cell("a", "fedrs", [90.0])]
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", cells)}
    rows = {(r.setting, r.method): r for r in load_rows(tmp_path, sets)}
    assert [b.caption for b in rows["Setting A", "fedavg"].beside] == ["drawn", "a lower lr"]
    table = peers_table(list(rows.values()))
    assert "drawn: 81.00 (1), +1.00 (one seed: no interval); a lower lr: 76.00 ± 1.00 (2), -4.0 [" in table[2]
    assert rows["Setting B", "fedavg"].beside == () and rows["Setting A", "fedrs"].beside == ()
    for bad, message in (
        ({"fedprox": {"fedprox-mu": "mu"}}, r"variants: methods \['fedprox'\] not under `rows`"),
        ({"fedavg": "fedavg-lr"}, r"peers\.x\.variants=.* is not allowed: must map a method"),
    ):
        raw["peers"]["x"]["variants"] = bad
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match=message):
            load_rows(tmp_path, {})


def test_the_peers_own_code_run_here_stands_beside_ours(tmp_path: Path) -> None:
    """A peer's `reference` file (its code run here) adds, to its setting's rows of the methods it
    holds, its number over its seeds with the gap; none before the file exists; a file naming
    another setting, a seed that is not an integer or a value that is not a percentage is refused."""
    path = _published(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["peers"]["x"]["reference"] = {"file": "results/peers/ref.yaml", "caption": "their code run here"}
    path.write_text(yaml.safe_dump(raw))
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [_cell("a", "fedavg", [80.0, 80.0])])}
    assert all(r.beside == () for r in load_rows(tmp_path, sets))
    ref = tmp_path / "results" / "peers" / "ref.yaml"
    ref.write_text(yaml.safe_dump({"format": 1, "setting": "a", "best": {"fedavg": {0: 81.0, 1: 83.0}}}))
    table = peers_table(load_rows(tmp_path, sets))
    assert table[2].endswith("| their code run here: 82.00 ± 1.00 (2), +2.0 [-4.0, +8.0] |  |")
    assert table[3].endswith("|  |  |")  # fedrs: not in the file
    for bad, key in [
        ({"setting": "z", "best": {"fedavg": {0: 81.0}}}, "setting"),
        ({"setting": "a", "best": {"fedavg": {"0": 81.0}}}, "best.fedavg"),
        ({"setting": "a", "best": {"fedavg": {0: 181.0}}}, "best.fedavg.0"),
    ]:
        ref.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=rf"{key}=.* is not allowed"):
            load_rows(tmp_path, sets)
    raw["peers"]["x"]["reference"]["file"] = "results/../../etc/passwd"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"reference\.file=.* must be a path under results/peers/"):
        load_rows(tmp_path, sets)


def test_a_seed_whose_run_stopped_is_named_in_its_row(tmp_path: Path) -> None:
    """A diverged seed counts with the rounds it ran, and the row says which seed stopped where."""
    from dataclasses import replace

    _published(tmp_path)
    cell = replace(_cell("a", "fedavg", [83.0, 37.6]), stopped={1: 46})
    rows = load_rows(tmp_path, {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [cell])})
    assert (
        "60.30 ± 22.70 (`global.best`, 2); seed 1 stopped at round 46, its statistic over the rounds before |"
        in (peers_table(rows)[2])
    )


def test_a_bad_published_file_names_the_key(tmp_path: Path) -> None:
    """A file the table cannot show as it is (a wrong shape, an absurd number, Markdown in a name) is
    refused with the key named, never drawn."""
    path = _published(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["peers"]["x"]["rows"]["fedavg"]["c"] = {"mean": 1.0, "std": 0.0}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"peers\.x: rows\.fedavg: settings \['c'\] not under `settings`"):
        load_rows(tmp_path, {})
    raw["peers"]["x"]["rows"]["fedavg"].pop("c")
    del raw["peers"]["x"]["runs"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="`runs` must be a int"):
        load_rows(tmp_path, {})
    # values inside the file's shape that the table could not show as they are: each refused, named
    hostile = [
        (("runs",), 1, r"peers\.x\.runs=1 is not allowed: must be an integer >= 2"),
        (("rows", "fedavg", "a", "std"), 1e308, r"rows\.fedavg\.a\.std=1e\+308 is not allowed: must be a number"),
        (("rows", "fedavg", "a"), "80 +- 1", r"rows\.fedavg\.a='80 \+- 1' is not allowed: must be a mapping"),
        (("ours", "fedrs"), "global.best`\n| x |", r"ours\.fedrs=.* is not allowed: must be a statistic"),
        (("ours", "fedrs"), "global.best\n", r"ours\.fedrs=.* is not allowed: must be a statistic"),
        (("gaps",), {"fedrs": "a reason without its setting"}, r"peers\.x\.gaps=.* is not allowed"),
    ]
    for keys, value, message in hostile:
        bad = yaml.safe_load(yaml.safe_dump(raw))
        bad["peers"]["x"]["runs"] = 3
        node = bad["peers"]["x"]
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=message):
            load_rows(tmp_path, {})
    path.write_text("peers: {x: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_rows(tmp_path, {})


def test_the_committed_file_matches_its_suites() -> None:
    """Every published setting is a partition of the peer's suite and every method one of its methods,
    so that the suite's export fills every row."""
    raw = yaml.safe_load((ROOT / PUBLISHED).read_text())
    for key, peer in raw["peers"].items():
        suite = yaml.safe_load((ROOT / peer["suite"]).read_text())
        beside = {other for by_setting in (peer.get("beside") or {}).values() for other in by_setting}
        assert set(peer["settings"]) | beside <= set(suite["partitions"]), key
        variants = {other for by_method in (peer.get("variants") or {}).values() for other in by_method}
        assert set(peer["rows"]) | variants <= set(suite["methods"]), key
    assert len(load_rows(ROOT, {})) == 24  # 8 niid_bench rows and 16 of PFLlib


def test_a_cell_recorded_under_another_config_than_the_suites_says_which_keys(tmp_path: Path) -> None:
    """The suite now turns a bound off that the recorded runs had on: the row keeps its numbers but
    names the key, its old and new value; a key the suite now sets to its default is no change, and a
    cell whose config is the suite's says nothing."""
    _published(tmp_path)
    base = {"lr": 0.01, "update-norm-bound": 0.0, "max-update-ratio": 10.0}  # the last one: its default
    suite = {"base": base, "methods": {"fedavg": {}, "fedrs": {}}}
    suite["partitions"] = {"a": {"partition": "dirichlet", "seeds": [0, 1]}}
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "peer-x.yaml").write_text(yaml.safe_dump(suite))
    old = _cell("a", "fedavg", [79.0, 80.0, 81.0])
    old.config = {"lr": 0.01, "partition": "dirichlet", "method": "fedavg"}
    same = _cell("a", "fedrs", [80.0, 81.0])
    same.config = {"lr": 0.01, "partition": "dirichlet", "method": "fedrs", "update-norm-bound": 0.0}
    sets = {"peer-x": ResultSet("peer-x", "peer-x", "suites/peer-x.yaml", [old, same])}
    rows = {r.method: r for r in load_rows(tmp_path, sets) if r.setting == "Setting A"}
    assert rows["fedavg"].changed == ("update-norm-bound 3.0 → 0.0",) and rows["fedrs"].changed == ()
    table = "\n".join(peers_table(list(rows.values())))
    assert "recorded under an earlier config (update-norm-bound 3.0 → 0.0), to run again" in table
