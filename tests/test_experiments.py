"""Experiment suites: validation, progress, skipping finished cells (resume), the report."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

from fedskew.config import ConfigError
from fedskew.run import experiments
from fedskew.run.experiments import load_suite, run_suite, select
from tests.harness import ROOT, app_defaults

SUITE = """
name: t
num-supernodes: 5
seeds: [0, 1]
out-dir: {out}
base: {{num-server-rounds: 3, partition: iid}}
methods:
  fedavg: {{}}
  rs: {{method: fedrs, fedrs-alpha: 0.5}}
partitions:
  iid: {{}}
  c2: {{partition: classes-per-client, classes-per-client: 2}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


def fake_simulation(calls: list, crash_at: int | None = None):
    def run(app_dir, overrides, n, fed=(), stream=True, resources=None, link=None):
        assert link == "one link for the suite" and resources.actors >= 1
        calls.append(overrides["run-name"])
        if crash_at is not None and len(calls) == crash_at:
            raise KeyboardInterrupt
        d = Path(overrides["out-dir"]) / overrides["run-name"]
        d.mkdir(parents=True, exist_ok=True)
        acc = 0.5 + 0.1 * overrides["seed"] + (0.2 if overrides["method"] == "fedrs" else 0.0)
        rows = [{"round": r, "global-accuracy": acc * r / 3, "personalized-accuracy": acc} for r in (1, 2, 3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {
            "final_global_accuracy": acc,
            "best_global_accuracy": acc,
            "final_personalized_accuracy": acc,
            "wall_seconds": 1.0,
        }
        (d / "summary.json").write_text(json.dumps(summary))
        return summary

    return run


def test_suite_runs_resumes_and_reports(tmp_path, monkeypatch, capsys) -> None:
    suite = load_suite(write(tmp_path, SUITE.format(out=tmp_path / "out")), app_defaults())
    assert len(suite.cells) == 8
    calls: list = []
    heads: list = []  # the Ray head's plan each suite run starts (one for all its cells)
    monkeypatch.setattr(
        experiments,
        "simulation_link",
        lambda app_dir, head, cluster: heads.append(head) or contextlib.nullcontext("one link for the suite"),
    )
    monkeypatch.setattr(experiments, "run_simulation", fake_simulation(calls, crash_at=3))
    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, ROOT)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(experiments, "run_simulation", fake_simulation(calls))
    run_suite(suite, ROOT)
    out = capsys.readouterr().out
    assert "8 cells, 2 already done" in out and "[8/8]" in out and "left" in out
    assert len(calls) == 6  # the two finished cells were skipped, the interrupted one re-run
    assert len(heads) == 2 and heads[0] == heads[1] and heads[0].actors >= 1  # every cell: the same plan
    md = (suite.folder / "results.md").read_text()
    # columns: global last-10 mean, final, best, ... (global accuracy is acc * r / 3 over rounds 1-3)
    # the oscillation is the std over rounds of acc * r / 3: acc * 0.272, averaged over the two seeds
    assert "| iid | rs | 2 | 50.00 ± 3.33 | 20.41 ± 1.36 | 75.00 ± 5.00 | 75.00 ± 5.00 |" in md
    assert "| c2 | fedavg | 2 | 36.67 ± 3.33 | 14.97 ± 1.36 | 55.00 ± 5.00 | 55.00 ± 5.00 |" in md
    assert "FedAvg-FT" in md  # fedavg's personalized model is named for what it is
    assert (suite.folder / "results.csv").read_text().count("\n") == 5
    assert (suite.folder / "accuracy-iid.png").is_file() and (suite.folder / "accuracy-c2.png").is_file()
    # the comparison printed at the end: one line per cell (balanced / worst class: not in these runs)
    line = next(x for x in out.splitlines() if x.startswith("iid ") and " rs " in x)
    assert line.split() == ["iid", "rs", "2", "50.00", "n/a", "n/a", "75.00"]
    assert f"plots: {suite.folder / 'accuracy-iid.png'}" in out


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: x\nbogus: 1\n", "unknown key 'bogus'"),
        ("seeds: [0, -1]\n", "seeds=[0, -1]"),
        ("seeds: 3\n", "must be a non-empty list"),
        ("seeds: [1, 1]\n", "distinct"),
        ("seeds: [true]\n", "seeds=[True]"),
        ("partitions: {p: {seeds: []}}\n", "partitions.p: seeds=[]"),
        ("partitions: {p: {seeds: [0, 2.5]}}\n", "partitions.p: seeds=[0, 2.5]"),
        ("methods: [fedavg]\n", "methods: must be a mapping"),
        ("methods: {fedfoo: {}}\n", "cell default/fedfoo/seed 0: method='fedfoo'"),
        ("methods: {x: {method: fedrs, fedrs-alpha: 3}}\n", "fedrs-alpha=3.0"),
        ("partitions: {p: {classes-per-client: 20}}\n", "classes-per-client=20"),
        ("num-supernodes: 0\n", "num-supernodes=0"),
        ("num-supernodes: 3\n", "some class would have no client"),
        ("partitions: {p: {num-supernodes: 2.5}}\n", "partitions.p: num-supernodes=2.5"),
        ("last-rounds: 0\n", "last-rounds=0"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_suites_fail_with_the_key(tmp_path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_suite(write(tmp_path, text), app_defaults())
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_shipped_suites_validate() -> None:
    for path in sorted((ROOT / "suites").glob("*.yaml")):
        assert load_suite(path, app_defaults()).cells, path


def test_a_partition_may_set_its_own_number_of_clients(tmp_path) -> None:
    text = "num-supernodes: 10\npartitions:\n  p5: {num-supernodes: 5}\n  p10: {}\n"
    suite = load_suite(write(tmp_path, text), app_defaults())
    assert {c.partition: c.num_supernodes for c in suite.cells} == {"p5": 5, "p10": 10}
    assert all("num-supernodes" not in c.overrides for c in suite.cells)  # not a run-config key


def test_a_partition_may_set_its_own_seeds(tmp_path) -> None:
    """A setting whose gains spread more runs more seeds; each seed is the same cell config whichever
    list names it (the result file's hash, so no recorded seed is lost by moving it)."""
    text = "seeds: [0, 1]\npartitions:\n  wide: {seeds: [0, 1, 2, 3]}\n  narrow: {}\n"
    suite = load_suite(write(tmp_path, text), app_defaults())
    assert sorted((c.partition, c.seed) for c in suite.cells) == [
        *(("narrow", s) for s in (0, 1)),
        *(("wide", s) for s in (0, 1, 2, 3)),
    ]
    assert all("seeds" not in c.overrides for c in suite.cells)  # not a run-config key
    assert [c.partition for c in select(suite, seeds=[3])] == ["wide"]  # a seed only one setting runs
    plain = load_suite(write(tmp_path, "seeds: [0, 1]\npartitions:\n  wide: {}\n"), app_defaults())
    assert [c.overrides for c in plain.cells] == [c.overrides for c in suite.cells if c.partition == "wide"][:2]


def stopped_in_round_3(tmp_path: Path, method: str = "fedavg", keep_node_states: bool = False):
    """(the suite, its first cell, the cell's config) after a real run of the cell, `method` in place
    of fedavg, stopped in round 3 (checkpoint after round 2), on a grid that keeps its nodes'
    states with `keep_node_states`."""
    from flwr.app import Error, Message

    from tests.harness import run_in_process

    text = SUITE.format(out=tmp_path / "out").replace(
        "base: {{num-server-rounds: 3, partition: iid}}".format(),  # the template's braces, unescaped
        "base: {num-server-rounds: 3, partition: iid, model: mlp, checkpoint-every: 1, round-retries: 0}",
    )
    suite = load_suite(write(tmp_path, text.replace("  fedavg: {}\n", f"  {method}: {{}}\n")), app_defaults())
    cell = suite.cells[0]
    over = {**cell.overrides, "out-dir": str(suite.folder), "run-name": cell.run_name}
    cfg, _ = experiments.prepare_config(ROOT, over, cell.num_supernodes)
    crash = {(p, 3): lambda msg, reply: Message(Error(code=0, reason="stop"), reply_to=msg) for p in range(5)}
    with pytest.raises(RuntimeError):
        run_in_process(cfg, cell.num_supernodes, crash, keep_node_states=keep_node_states)
    assert experiments.stopped_round(suite.folder / cell.run_name, cfg) == 2
    return suite, cell, cfg


def test_a_cell_stopped_part_way_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys, task_identity) -> None:
    """A real run stopped in round 3 (checkpoint after round 2): the suite continues it with
    resume=true; the same cell with a changed config starts afresh."""
    from tests.harness import run_in_process

    suite, cell, cfg = stopped_in_round_3(tmp_path)
    run_dir = suite.folder / cell.run_name
    assert experiments.stopped_round(run_dir, {**cfg, "lr": cfg["lr"] / 2}) == 0  # another config: afresh

    seen: dict = {}
    monkeypatch.setattr(
        experiments, "simulation_link", lambda app_dir, head, cluster: contextlib.nullcontext("one link for the suite")
    )

    def resume_only_the_stopped_cell(app_dir, overrides, n, **kwargs):
        seen[overrides["run-name"]] = overrides.get("resume", False)
        if overrides.get("resume"):  # what the ServerApp does with resume=true: continue from round 3
            run_in_process({**cfg, "resume": True}, cell.num_supernodes)
        return fake_simulation([])(app_dir, overrides, n, **kwargs)

    monkeypatch.setattr(experiments, "run_simulation", resume_only_the_stopped_cell)
    run_suite(suite, ROOT)
    assert seen.pop(cell.run_name) is True and not any(seen.values())
    assert "resuming after round 2" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["scaffold", "moon"])
def test_a_stopped_run_whose_clients_keep_state_runs_afresh(tmp_path, method, task_identity) -> None:
    """Its clients' state (SCAFFOLD's c_i, MOON's previous model) is not in the server's checkpoint,
    and a resumed simulation's clients start without it: the suite runs the cell again from round
    1 (its files set aside), saying why, instead of resuming a run that would differ."""
    suite, cell, _ = stopped_in_round_3(tmp_path, method)
    [plan] = experiments.plan_cells(suite, ROOT, [cell])
    assert plan.action == "afresh" and plan.overrides["overwrite"] is True and not plan.overrides.get("resume")
    assert (
        plan.note
        == f"not resumed after round 2: {method}'s clients keep "
        + ("the control variate c_i" if method == "scaffold" else "the previous local model")
        + " across rounds, which a resumed simulation starts without"
    )


@pytest.mark.parametrize("method", ["scaffold", "ditto"])
def test_a_stopped_run_whose_clients_keep_state_resumes_with_the_nodes_states_kept(
    tmp_path, method, task_identity
) -> None:
    """On an engine that keeps its nodes' states at each checkpoint round (the in-process grid of
    `suite_in_process.py`), the stopped run resumes on new nodes with the states put back and ends
    with the uninterrupted run's metrics to the last digit; its kept states go once it finishes.
    Resumed on new nodes without them, the same run differs: the states act."""
    from fedskew.run.node_states import kept_rounds
    from fedskew.server_app.results import read_jsonl, resumed_rounds, run_seconds
    from tests.harness import run_in_process

    suite, cell, cfg = stopped_in_round_3(tmp_path, method, keep_node_states=True)
    run_dir = suite.folder / cell.run_name
    assert kept_rounds(run_dir) == [1, 2]  # the checkpoint's round and the one before
    [plan] = experiments.plan_cells(suite, ROOT, [cell], node_states=True)
    assert (plan.action, plan.note) == ("resume", "after round 2, its nodes' states kept")
    assert plan.overrides["resume"] is True

    full = {**cfg, "run-name": "full"}
    run_in_process(full, cell.num_supernodes)
    blank = tmp_path / "blank"
    shutil.copytree(run_dir, blank)
    run_in_process({**cfg, "resume": True}, cell.num_supernodes, keep_node_states=True)
    expected = (suite.folder / "full" / "metrics.jsonl").read_text()
    assert (run_dir / "metrics.jsonl").read_text() == expected
    assert kept_rounds(run_dir) == []
    assert resumed_rounds(run_dir) == [2] and resumed_rounds(run_dir, without_node_states=True) == []
    first = [row["seconds"] for row in read_jsonl(run_dir / "timings.jsonl") if row["round"] <= 2]
    assert run_seconds(run_dir, 0.0) == sum(first) > 0  # its wall time counts the stopped process's rounds

    run_in_process({**cfg, "out-dir": str(tmp_path), "run-name": "blank", "resume": True}, cell.num_supernodes)
    assert (blank / "metrics.jsonl").read_text() != expected
    assert resumed_rounds(blank, without_node_states=True) == [2]  # what an export leaves out


def test_states_an_earlier_run_kept_go_once_a_new_run_in_the_folder_starts(tmp_path, task_identity) -> None:
    """Kept states of an earlier run of the same config stay while the server may still refuse the new
    run, and go at its first message, so that its checkpoint is never paired with them."""
    from flwr.app import Error, Message

    from fedskew.run.node_states import kept_rounds, save_node_states
    from tests.harness import run_in_process

    cfg = {"model": "mlp", "partition": "iid", "num-server-rounds": 3, "checkpoint-every": 1, "round-retries": 0}
    cfg |= {"method": "scaffold", "out-dir": str(tmp_path), "run-name": "r"}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"round": 1}\n')  # an earlier run's results: refused
    save_node_states(tmp_path / "r", 2, experiments.validate({**app_defaults(), **cfg}), {})
    with pytest.raises(ConfigError):
        run_in_process(cfg, 2, num_partitions=50, keep_node_states=True)
    assert kept_rounds(tmp_path / "r") == [2]
    crash = {(p, 1): lambda msg, reply: Message(Error(code=0, reason="stop"), reply_to=msg) for p in range(2)}
    with pytest.raises(RuntimeError):
        run_in_process({**cfg, "overwrite": True}, 2, crash, num_partitions=50, keep_node_states=True)
    assert kept_rounds(tmp_path / "r") == []


def test_a_resume_without_its_nodes_states_starts_afresh_and_says_why(tmp_path, task_identity) -> None:
    """The kept states missing, damaged or of another config: the plan starts the cell afresh naming
    the file and the fault, and the grid refuses to resume such a method without them."""
    from fedskew.run.node_states import node_states_path, save_node_states
    from tests.harness import run_in_process

    suite, cell, cfg = stopped_in_round_3(tmp_path, "moon", keep_node_states=True)
    path = node_states_path(suite.folder / cell.run_name, 2)

    def note() -> str:
        [plan] = experiments.plan_cells(suite, ROOT, [cell], node_states=True)
        assert plan.action == "afresh" and not plan.overrides.get("resume")
        return plan.note

    full = experiments.validate({**app_defaults(), **cfg})
    save_node_states(path.parent, 2, {**full, "lr": full["lr"] / 2}, {})
    assert note().endswith(f"{path}: kept by a run of another config: lr")
    path.write_bytes(b"not a torch file")
    assert f"{path} does not load" in note()
    path.unlink()
    assert note() == (
        "not resumed after round 2: moon's clients keep the previous local model across rounds, which a resumed "
        f"simulation starts without, and {path} is missing: the nodes' states after round 2 were not kept"
    )
    with pytest.raises(RuntimeError, match="cannot resume after round 2: moon's clients keep"):
        run_in_process({**cfg, "resume": True}, cell.num_supernodes, keep_node_states=True)


def test_the_cli_runs_only_the_chosen_cells_and_reports_every_finished_one(tmp_path, monkeypatch, capsys) -> None:
    from fedskew import cli

    path = write(tmp_path, SUITE.format(out=tmp_path / "out"))
    calls: list = []
    monkeypatch.setattr(
        experiments, "simulation_link", lambda app_dir, head, cluster: contextlib.nullcontext("one link for the suite")
    )
    monkeypatch.setattr(experiments, "run_simulation", fake_simulation(calls))
    assert cli.main(["experiment", str(path), "--methods", "rs", "--partitions", "c2", "--seeds", "1"]) == 0
    assert calls == ["c2--rs--s1"]
    assert "1 cells of the suite's 8, 0 already done" in capsys.readouterr().out
    assert cli.main(["experiment", str(path), "--partitions", "c2"]) == 0
    assert sorted(calls) == sorted(["c2--rs--s1", "c2--fedavg--s0", "c2--fedavg--s1", "c2--rs--s0"])
    assert "4 cells of the suite's 8, 1 already done" in capsys.readouterr().out
    md = (tmp_path / "out" / "t" / "results.md").read_text()
    assert "| c2 | rs | 2 |" in md and "| c2 | fedavg | 2 |" in md and "| iid |" not in md
    assert (tmp_path / "out" / "t" / "accuracy-c2.png").is_file()
    assert not (tmp_path / "out" / "t" / "accuracy-iid.png").exists()  # nothing finished there: no empty plot
    # a label or seed the suite lacks is refused, naming it and what the suite has; nothing runs
    for argv, needle in (
        (["--methods", "fedrs"], "no method 'fedrs' (it has: fedavg, rs)"),
        (["--partitions", "iid,c3"], "no partition 'c3' (it has: iid, c2)"),
        (["--seeds", "2"], "no seed 2 (it has: 0, 1)"),
        (["--seeds", "0,x"], "--seeds '0,x' is not allowed"),
    ):
        assert cli.main(["experiment", str(path), *argv]) == 2
        assert needle in capsys.readouterr().err
    assert len(calls) == 4


def test_the_report_has_balanced_and_worst_class_columns_and_a_per_class_part(tmp_path) -> None:
    """Per partition: the classes one client holds (from each seed's partition.json), each method's
    per-class accuracy (last-k mean, mean over seeds) with its worst class, and the panel."""
    suite = load_suite(write(tmp_path, SUITE.format(out=tmp_path / "out")), app_defaults())
    for cell in suite.cells:
        d = suite.folder / cell.run_name
        d.mkdir(parents=True)
        lost = 0.0 if cell.method == "fedavg" else 0.5  # fedavg loses class 2
        rows = [
            {
                "round": r,
                "global-accuracy": 0.6,
                "global-per-class-accuracy": [0.9, 0.6 + 0.1 * cell.seed, lost, None],
                "global-balanced-accuracy": (1.5 + 0.1 * cell.seed + lost) / 3,
                "global-worst-class-accuracy": lost,
            }
            for r in (1, 2, 3)
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps({"wall_seconds": 1.0}))
        skew = {"dominated-classes": [{"class": 2, "client": 3 + cell.seed, "share": 0.97}]}
        (d / "partition.json").write_text(json.dumps({"skew": skew}))
    experiments.write_report(suite)
    md = (suite.folder / "results.md").read_text()
    assert "balanced, last 10 | worst class, last 10 |" in md
    assert (
        "| iid | fedavg | 2 | 60.00 ± 0.00 | 0.00 ± 0.00 | 60.00 ± 0.00 | 60.00 ± 0.00 | 51.67 ± 1.67 | 0.00 ± 0.00 |"
        in md
    )
    assert "client-global" not in md.split("\n|---")[0].split("\n")[-1]  # no column without any value
    assert "- seed 0: classes held > 90 % by one client: 2 (97 % on client 3)" in md
    assert "- seed 1: classes held > 90 % by one client: 2 (97 % on client 4)" in md
    assert "| fedavg | 2 | 90.0 | 65.0 | 0.0 | absent | 2 |" in md
    assert "| rs | 2 | 90.0 | 65.0 | 50.0 | absent | 2 |" in md
    assert (suite.folder / "per-class-iid.png").is_file() and (suite.folder / "per-class-c2.png").is_file()
