"""The benchmark scripts run (`--quick`, tiny sizes) and print their ratios."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedskew.config import ConfigError
from fedskew.run.experiments import run_name
from tests.conftest import ROOT


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`benchmarks/<script> <args>` run as a user would, one BLAS thread, at most 120 s."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("train_loop.py", ["ratio to plain", "ratio augmented / fedskew"]),
        ("client_time.py", ["ratio to fedavg", "mupfl", "fedgela"]),
        ("server_steps.py", ["t(N)/t(3)", "mupfl ACMU", "mupfl PKCF", "fedmr prototypes"]),
        ("scale.py", ["ratio 40/20", "round - central eval s", "Python memory per extra idle node"]),
        ("deploy_breakdown.py", ["share", "ratio first / later message", "import torch"]),
        ("mupfl_bavd.py", ["ratio bavd / plain accuracy", "activations kept", "rescaled", "top-K 90 %"]),
        ("fedgela_etf.py", ["cos class mean / classifier", "ratio adapted / plain-ETF evaluation", "no adaptation"]),
        ("cuda_paths.py", ["fedavg   lenet     cpu     global acc", "finite True", "runs failed: 0"]),
        ("class_metrics.py", ["on + personalized-central-eval", "extra per round", "ratio (round + central test set"]),
        ("batched.py", ["batched          clients/s", "ratio to per-client   1.00", "load average after"]),
    ],
)
def test_benchmark_prints_its_ratios(script: str, expected: list[str]) -> None:
    res = run_benchmark(script, "--quick")
    assert res.returncode == 0, res.stderr[-3000:]
    for text in expected:
        assert text in res.stdout, res.stdout[-3000:]


def test_batched_step_names_what_a_stacked_step_spends_its_time_on() -> None:
    res = run_benchmark("batched.py", "step", "--device", "cpu", "--clients", "2", "--repeats", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    for text in ("stacked", "ratio to per-client 1.00", "self CPU ms a step by op: aten::"):
        assert text in res.stdout, res.stdout[-3000:]


def test_fedgela_etf_reads_a_cell_run_without_fedrs_traces_worst_classes_and_runs_ga_side_alone() -> None:
    ok = run_benchmark("fedgela_etf.py", "--quick", "--methods", "fedavg", "fedgela", "fedge")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "fedrs" not in ok.stdout, ok.stdout[-3000:]
    for m in ("fedgela", "fedge"):  # the worst class traced to its owner for both ETF runs
        assert f"{m:8s} worst class: class" in ok.stdout and "owner's adapted-ETF accuracy" in ok.stdout, ok.stdout
    ga = run_benchmark("fedgela_etf.py", "--quick", "--methods", "fedge")  # a cell with FedGE runs only
    assert ga.returncode == 0, ga.stderr[-3000:]
    assert "GA side only" in ga.stdout and "fedge    worst class: class" in ga.stdout, ga.stdout[-3000:]
    assert "seed 0 fedavg" not in ga.stdout and "PA:" not in ga.stdout, ga.stdout[-3000:]


def write_map_runs(runs: Path, fedavg_clients: list[int], map_label: str = "map", stage2: bool = True) -> None:
    """A 4-round MAP (`map_label`) and `fedavg` run of seed 0 with known per-round metrics (no FedRS run);
    without `stage2` the MAP run lacks `stage2-accuracy`."""
    stage2_metric = {"stage2-accuracy": 0.89} if stage2 else {}
    per_method = {
        map_label: {"personalized-accuracy": 0.90, "global-accuracy": 0.88} | stage2_metric,
        "fedavg": {"personalized-accuracy": 0.895, "global-accuracy": 0.86},
    }
    for method, metrics in per_method.items():
        run = runs / run_name("p", method, 0)
        run.mkdir(parents=True)
        clients = fedavg_clients if method == "fedavg" else [1, 2]
        lines = [{"round": r, "partitions": clients, "hpm-mu-mean": 0.1 * r, **metrics} for r in range(1, 5)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        (run / "summary.json").write_text("{}")


def test_map_hpm_pairs_the_runs_by_round_and_refuses_unpaired_or_missing_runs(tmp_path: Path) -> None:
    rest = ["--part", "p", "--seeds", "0", "--windows", "1-2", "3-4", "4-9"]  # 4-9: past the runs, dropped
    write_map_runs(tmp_path / "ok", [2, 1])
    ok = run_benchmark("map_hpm.py", "--runs", str(tmp_path / "ok"), *rest)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "mu at round 2: 0.20" in ok.stdout, ok.stdout
    assert "HPM - its stage-2 model    1-2: +1.00 (2/2 > 0) | 3-4: +1.00 (2/2 > 0)\n" in ok.stdout, ok.stdout
    assert "HPM - FedAvg-FT            1-2: +0.50 (2/2 > 0)" in ok.stdout, ok.stdout
    assert "stage-2 model - FedAvg-FT  1-2: -0.50 (0/2 > 0)" in ok.stdout, ok.stdout
    assert "global, MAP - FedAvg       1-2: +2.00" in ok.stdout and "FedRS" not in ok.stdout, ok.stdout
    write_map_runs(tmp_path / "unpaired", [1, 3])
    bad = run_benchmark("map_hpm.py", "--runs", str(tmp_path / "unpaired"), *rest)
    assert bad.returncode != 0 and "round 1 sampled different clients" in bad.stderr, bad.stderr[-3000:]
    missing = run_benchmark("map_hpm.py", "--runs", str(tmp_path / "none"), *rest)
    assert missing.returncode != 0 and "no finished run" in missing.stderr, missing.stderr[-3000:]
    write_map_runs(tmp_path / "code", [1, 2], map_label="map-code")  # the authors'-code variant's label
    code = run_benchmark("map_hpm.py", "--runs", str(tmp_path / "code"), "--method", "map-code", *rest)
    assert code.returncode == 0 and "HPM - its stage-2 model    1-2: +1.00" in code.stdout, code.stderr[-3000:]
    write_map_runs(tmp_path / "nostage2", [1, 2], stage2=False)
    lacks = run_benchmark("map_hpm.py", "--runs", str(tmp_path / "nostage2"), *rest)
    lacking = "seed 0 map: round 1 has no numeric 'stage2-accuracy'"
    assert lacks.returncode != 0 and lacking in lacks.stderr, lacks.stderr[-3000:]
    wrong = run_benchmark("map_hpm.py", "--windows", "10-1")
    assert wrong.returncode == 2 and "need 1 <= FIRST <= LAST" in wrong.stderr, wrong.stderr[-3000:]


def test_suite_in_process_stops_every_cell_within_one_grace(monkeypatch) -> None:
    """At the deadline every running cell gets SIGTERM before any is waited for, the waits share one
    grace (not one each, which for many cells could outlast a GPU machine's command), a cell still
    running after it gets SIGKILL, and one that ended meanwhile is not an error."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import suite_in_process as sip

    clock, events = [0.0], []

    class Cell:
        def __init__(self, pid: int, ended: bool = False) -> None:
            self.pid, self.ended = pid, ended

        def poll(self) -> int | None:
            return 0 if self.ended else None

        def wait(self, timeout: float | None = None) -> int:
            events.append(("wait", self.pid, timeout))
            if timeout is None:  # after SIGKILL
                return -9
            clock[0] += timeout  # ignores SIGTERM until the timeout
            raise subprocess.TimeoutExpired("cell", timeout)

    def killpg(pid: int, sig) -> None:
        if pid == 3:
            raise ProcessLookupError  # ended between poll and signal
        events.append((sig.name, pid))

    monkeypatch.setattr(sip.os, "killpg", killpg)
    monkeypatch.setattr(sip.time, "monotonic", lambda: clock[0])
    sip.stop([Cell(1), Cell(2), Cell(3), Cell(4, ended=True)], grace=10.0)
    assert events[:2] == [("SIGTERM", 1), ("SIGTERM", 2)]  # all signalled first; 4 had ended
    waited = [e[2] for e in events if e[0] == "wait" and e[2] is not None]
    assert sum(waited) == pytest.approx(10.0) and clock[0] == pytest.approx(10.0)
    assert ("SIGKILL", 1) in events and ("SIGKILL", 2) in events and all(e[1] != 4 for e in events)


def test_suite_in_process_runs_the_chosen_cells_at_once_and_stops_them_at_the_deadline(
    tmp_path: Path, small_data: str
) -> None:
    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\nnum-supernodes: 5\nseeds: [0, 1]\nout-dir: {tmp_path}\n"
        "base: {num-server-rounds: 2, partition: classes-per-client, classes-per-client: 2,"
        f" data-root: {small_data}}}\n"
        "methods: {fedavg: {}, fedrs-0.5: {method: fedrs, fedrs-alpha: 0.5}}\n"
    )
    ok = run_benchmark("suite_in_process.py", str(suite), "--seeds", "0", "--jobs", "2", "--set", "local-epochs=1")
    assert ok.returncode == 0, ok.stderr[-3000:]
    for m in ("fedavg", "fedrs-0.5"):  # both cells of seed 0, every round, in the table
        assert f"| {run_name('default', m, 0)} | 2 | " in ok.stdout, ok.stdout
        rows = (tmp_path / "s-in-process" / run_name("default", m, 0) / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["round"] for r in rows] == [1, 2]
    assert run_name("default", "fedavg", 1) not in ok.stdout
    late = run_benchmark(
        "suite_in_process.py", str(suite), "--methods", "fedavg", "--seeds", "1",
        "--set", "num-server-rounds=500", "--deadline", "15", "--tag", "late",
    )  # fmt: skip
    assert late.returncode == 0, late.stderr[-3000:]
    assert "deadline 15 s: stopped 1 running" in late.stdout, late.stdout
    # how many rounds ended before the deadline depends on the machine's load (none on a busy one):
    # the table reports what the run's metrics hold, and the run ended long before its 500 rounds
    metrics = tmp_path / "s-late" / run_name("default", "fedavg", 1) / "metrics.jsonl"
    done = metrics.read_text().splitlines() if metrics.is_file() else []
    assert len(done) < 500 and f"| {run_name('default', 'fedavg', 1)} | {len(done)} | " in late.stdout, late.stdout
    bad = run_benchmark("suite_in_process.py", str(suite), "--methods", "fedprox")
    assert bad.returncode != 0 and "no method 'fedprox'" in bad.stderr, bad.stderr


def test_suite_in_process_into_suite_fills_the_suite_s_own_folder_as_fedskew_experiment_would(
    tmp_path: Path, small_data: str
) -> None:
    """`--into-suite`: the cells land in the suite's folder, where `plan_cells` (what `fedskew
    experiment` runs and exports) counts them done; a second call skips them; --set is refused. The
    queue's `each` item lists from `scripts/rerun_cells.py`'s `pending_cells` the cells a seed still runs."""
    from fedskew.reports.resultfile import load_results
    from fedskew.run.experiments import load_suite, plan_cells
    from fedskew.run.launcher import app_defaults

    spec = importlib.util.spec_from_file_location("rerun_cells", ROOT / "scripts" / "rerun_cells.py")
    rerun_cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rerun_cells)

    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\nnum-supernodes: 5\nseeds: [0]\nout-dir: {tmp_path}\n"
        "base: {num-server-rounds: 2, local-epochs: 1, partition: classes-per-client, classes-per-client: 2,"
        f" data-root: {small_data}}}\n"
        "methods: {fedavg: {}, fedrs-0.5: {method: fedrs, fedrs-alpha: 0.5}}\n"
    )
    pending = rerun_cells.pending_cells(load_suite(str(suite), app_defaults(ROOT)), 0, rerun_changed=False)
    assert pending == ["default/fedavg", "default/fedrs-0.5"], pending
    some = rerun_cells.pending_cells(load_suite(str(suite), app_defaults(ROOT)), 0, False, ["fedrs-0.5", "fedavg"])
    assert some == ["default/fedrs-0.5", "default/fedavg"], some  # the methods given, in their order
    with pytest.raises(ConfigError, match="no method 'fedprox'"):
        rerun_cells.pending_cells(load_suite(str(suite), app_defaults(ROOT)), 0, False, ["fedprox"])
    assert rerun_cells.batches(pending, 0) == [pending] and rerun_cells.batches(pending, 1) == [[c] for c in pending]
    assert rerun_cells.batches([], 0) == []
    results = tmp_path / "results"
    results.mkdir()
    ok = run_benchmark(
        "suite_in_process.py", str(suite), "--into-suite", "--jobs", "2", "--export-each", "--results-dir", str(results)
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "2 cells of s, 2 at once" in ok.stdout, ok.stdout
    for cell in ("fedavg", "fedrs-0.5"):  # each exported as it finished
        assert f"{run_name('default', cell, 0)}: exported into {results / 's.yaml'}" in ok.stdout, ok.stdout
    assert sorted(c.method for c in load_results(results / "s.yaml").cells) == ["fedavg", "fedrs-0.5"]
    loaded = load_suite(str(suite), app_defaults(ROOT))
    plans = plan_cells(loaded, ROOT)
    assert [p.action for p in plans] == ["done", "done"], [(p.cell.run_name, p.action, p.note) for p in plans]
    for p in plans:
        rows = (tmp_path / "s" / p.cell.run_name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["round"] for r in rows] == [1, 2]
    again = run_benchmark("suite_in_process.py", str(suite), "--into-suite")
    assert again.returncode == 0 and "0 cells of s" in again.stdout, again.stdout + again.stderr[-2000:]
    assert f"{run_name('default', 'fedavg', 0)}: done" in again.stdout, again.stdout
    assert rerun_cells.pending_cells(loaded, 0, rerun_changed=False) == []
    bad = run_benchmark("suite_in_process.py", str(suite), "--into-suite", "--set", "lr=0.1")
    assert bad.returncode != 0 and "--into-suite runs the suite's own cells" in bad.stderr, bad.stderr
    # a cell whose config changed is left alone, and run again (earlier files set aside) on request
    suite.write_text(suite.read_text().replace("fedavg: {}", "fedavg: {eval-batch-size: 512}"))
    changed = load_suite(str(suite), app_defaults(ROOT))
    assert rerun_cells.pending_cells(changed, 0, rerun_changed=False) == []
    assert rerun_cells.pending_cells(changed, 0, rerun_changed=True) == ["default/fedavg"]
    left = run_benchmark("suite_in_process.py", str(suite), "--into-suite", "--methods", "fedavg")
    assert left.returncode == 0 and "0 cells of s" in left.stdout and ": changed" in left.stdout, left.stdout
    rerun = run_benchmark("suite_in_process.py", str(suite), "--into-suite", "--rerun-changed", "--methods", "fedavg")
    assert rerun.returncode == 0 and "1 cells of s" in rerun.stdout, rerun.stdout + rerun.stderr[-2000:]
    plans = plan_cells(load_suite(str(suite), app_defaults(ROOT)), ROOT)
    assert [p.action for p in plans] == ["done", "done"], [(p.cell.run_name, p.action, p.note) for p in plans]
    assert list((tmp_path / "s" / run_name("default", "fedavg", 0)).glob("aside-*")), "earlier files not set aside"


def test_the_queue_passes_an_each_item_s_methods_to_the_cell_listing(tmp_path: Path) -> None:
    """`scripts/queue.sh`: an item `each/<suite>@A,B:<seeds>` asks `rerun_cells.py` for those methods'
    pending cells of each seed, one seed after the other; `each/<suite>:<seeds>` for all of them. Run
    with a stand-in interpreter that records its arguments and lists no cell."""
    log = tmp_path / "calls"
    fake = tmp_path / "py"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "FEDSKEW": "true", "QUEUE": "each/s@fedavg,fedrs:0-1 each/t:2-2"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "queue.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [
        "scripts/rerun_cells.py --suites s --pending 0 --group 0 --methods fedavg,fedrs",
        "scripts/rerun_cells.py --suites s --pending 1 --group 0 --methods fedavg,fedrs",
        "scripts/rerun_cells.py --suites t --pending 2 --group 0",
    ]


def test_suite_in_process_says_a_cell_stopped_and_exports_what_it_can(tmp_path: Path, small_data: str) -> None:
    """A cell whose every reply is refused (here: any update at all, `max-update-ratio` 1e-9) stops in
    round 1: the call says where it stopped, goes on, and its export leaves the run out, naming why
    (no round to count; a run that stopped later is counted over its rounds: tests/test_report.py)."""
    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\nnum-supernodes: 3\nseeds: [0]\nout-dir: {tmp_path}\n"
        "base: {num-server-rounds: 2, local-epochs: 1, partition: iid, model: mlp, round-retries: 0,"
        f" max-update-ratio: 1.0e-9, data-root: {small_data}}}\nmethods: {{fedavg: {{}}}}\n"
    )
    results = tmp_path / "results"
    results.mkdir()
    args = ("--into-suite", "--export-each", "--results-dir", str(results))
    out = run_benchmark("suite_in_process.py", str(suite), *args)
    name = run_name("default", "fedavg", 0)
    assert out.returncode == 0 and f"{name}: exit 1" in out.stdout, out.stdout + out.stderr[-3000:]
    assert f"{name}: stopped at round 1 (stopped.json), counted over the rounds before" in out.stdout, out.stdout
    assert "not exported, stopped at round 1: no round to count" in out.stderr, out.stderr[-3000:]
    assert json.loads((tmp_path / "s" / name / "stopped.json").read_text())["round"] == 1


def test_suite_in_process_resumes_a_cell_whose_clients_keep_state_with_the_nodes_states_kept(
    tmp_path: Path, task_identity
) -> None:
    """A SCAFFOLD cell stopped in round 3 on the in-process grid: `--into-suite` resumes it after
    round 2 with its nodes' states put back and ends as the uninterrupted run."""
    from fedskew.reports.resultfile import export_suite, load_results
    from fedskew.run.launcher import app_defaults
    from tests.harness import run_in_process
    from tests.test_experiments import stopped_in_round_3

    suite, cell, cfg = stopped_in_round_3(tmp_path, "scaffold", keep_node_states=True)
    only = ("--methods", cell.method, "--partitions", cell.partition, "--seeds", str(cell.seed))
    out = run_benchmark("suite_in_process.py", str(tmp_path / "suite.yaml"), "--into-suite", *only)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{cell.run_name}: resume (after round 2, its nodes' states kept)" in out.stdout, out.stdout
    run_in_process({**cfg, "run-name": "full"}, cell.num_supernodes)
    metrics = [(suite.folder / name / "metrics.jsonl").read_text() for name in (cell.run_name, "full")]
    assert metrics[0] == metrics[1] and len(metrics[0].splitlines()) == 3
    written = export_suite(suite, "suite.yaml", app_defaults(ROOT), tmp_path / "results", cells=[cell])
    [exported] = load_results(written).cells
    assert (exported.method, exported.seeds) == (cell.method, [cell.seed])  # resumed with its states: exported


def test_update_ratio_reports_each_cell_s_largest_ratio_and_refusals_and_fills_the_note(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "paper-x"
    for seed, ratios, refused in ((0, [0.5, 2.5, 1.0], 0), (1, [0.4, 0.9, 3.25], 2)):
        run = suite / f"p--fedavg--s{seed}"
        run.mkdir(parents=True)
        rows = [{"round": r + 1, "update-ratio-max": v} for r, v in enumerate(ratios)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        reason = "its update is 1e+38 times the norm of the model sent (max-update-ratio=10)"
        failures = [{"round": 2, "node": 1, "partition": seed, "reason": reason}] * refused
        (run / "failures.jsonl").write_text("".join(json.dumps(f) + "\n" for f in failures))
        (run / "config.json").write_text(json.dumps({"max-update-ratio": 10.0}))
        (run / "summary.json").write_text("{}")
    (suite / "p--fedavg--s2").mkdir()  # unfinished: no summary.json, left out
    note = tmp_path / "note.md"
    note.write_text("intro\n<!-- report:update-ratio begin -->\nold\n<!-- report:update-ratio end -->\nafter\n")
    res = run_benchmark("update_ratio.py", str(suite), "--write", str(note))
    assert res.returncode == 0, res.stderr[-3000:]
    row = "| paper-x | p | fedavg | 2 | 3.250 (3) | 2 | 10 |"
    assert row in res.stdout and "largest ratio over every run: 3.250" in res.stdout, res.stdout
    text = note.read_text()
    assert text.startswith("intro\n<!-- report:update-ratio begin -->\n| suite |") and "old" not in text
    assert row in text and text.endswith("<!-- report:update-ratio end -->\nafter\n")


def test_creff_heads_scores_the_evaluated_classifier_as_the_run_logged_it(tmp_path: Path, task_identity) -> None:
    from tests.harness import run_in_process

    over = {"method": "creff", "model": "mlp", "partition": "dirichlet", "fraction-train": 1.0}
    over |= {"num-server-rounds": 2, "checkpoint-every": 1, "out-dir": str(tmp_path), "run-name": "r"}
    over |= {"creff-features-per-class": 10, "creff-match-iters": 20, "creff-retrain-epochs": 20}
    run_in_process(over, 4, None, 20)
    res = run_benchmark("creff_heads.py", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr[-3000:]
    row = next(line for line in res.stdout.splitlines() if line.startswith("| r |")).split("|")
    logged = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])["global-accuracy"]
    assert row[2].strip() == "2" and float(row[4].split("/")[0]) == pytest.approx(100 * logged, abs=0.006)
    assert row[3] != row[4]  # the averaged classifier is another model


def test_finetune_trace_replays_the_run_and_logs_the_phase_s_steps_to_its_last(
    tmp_path: Path, small_data: str, task_identity
) -> None:
    """FedBABU's fine-tuning of one client in the last round, traced: the replay reproduces the run's
    last metrics row, the trace holds every 5th step and each of the last 3 before the step, and the
    phase's end after it, with its step count and the last batch logged. A run with a round missing,
    on the batched engine, or with a config.json that is not JSON or holds a bad value is refused
    with one line naming the fault."""
    from tests.harness import run_in_process

    over = {"method": "fedbabu", "model": "mlp", "partition": "classes-per-client", "fraction-train": 1.0}
    over |= {"num-server-rounds": 2, "fedbabu-finetune-epochs": 1, "local-test-fraction": 0.25, "batch-size": 64}
    run_in_process({**over, "data-root": small_data, "out-dir": str(tmp_path), "run-name": "r"}, 5, None, 5)
    res = run_benchmark(
        "finetune_trace.py",
        str(tmp_path / "r"),
        "--partition",
        "1",
        "--out",
        str(tmp_path / "t"),
        "--every",
        "5",
        "--tail",
        "3",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["reproduced"] is True and len(summary["phases"]) == 1, res.stdout
    phase = summary["phases"][0]
    rows = [json.loads(line) for line in (tmp_path / "t" / "trace.jsonl").read_text().splitlines()]
    n = phase["steps"]
    steps = [r["step"] for r in rows if not r.get("end")]
    assert steps == sorted({*range(0, n, 5), n - 3, n - 2, n - 1}) and rows[-1]["end"] is True
    assert 0 < phase["last-batch"]["size"] <= 64 and n == rows[-1]["phase-metrics"]["train-steps"]
    assert phase["accuracy-after"] == rows[-1]["accuracy"] and 0 <= phase["traced-accuracy-min"] <= 1
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "r" / "metrics.jsonl").write_text(metrics[0] + "\n")
    cut = run_benchmark("finetune_trace.py", str(tmp_path / "r"), "--partition", "1", "--out", str(tmp_path / "u"))
    assert cut.returncode != 0 and "1 rounds in metrics.jsonl, not 2" in cut.stderr, cut.stderr[-2000:]
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    (tmp_path / "r" / "config.json").write_text(json.dumps({**config, "engine": "batched"}))
    other = run_benchmark("finetune_trace.py", str(tmp_path / "r"), "--partition", "1", "--out", str(tmp_path / "u"))
    assert other.returncode != 0 and "engine='batched'; the trace follows" in other.stderr, other.stderr[-2000:]
    for text, fault in [("{not json", "config.json: missing, not JSON"), (json.dumps({**config, "lr": -1}), "lr")]:
        (tmp_path / "r" / "config.json").write_text(text)
        bad = run_benchmark("finetune_trace.py", str(tmp_path / "r"), "--partition", "1", "--out", str(tmp_path / "u"))
        assert bad.returncode != 0 and fault in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--jobs", "0"], "--jobs 0 is not allowed: must be 1 or more"),
        (["--set", "lr=abc"], "lr='abc' has type str: must be a float"),
        (["--set", "local-epochs=0"], "local-epochs=0 is not allowed"),
        (["--export", "../../X"], "export name '../../X' is not allowed"),
        (["--export", "claims"], "export name 'claims' is not allowed"),
        (["--set", "method=fedprox", "--export", "t-gpu"], "--set method='fedprox' is not allowed: method is what"),
        (["--set", "dirichlet-alpha=0.1"], "--set dirichlet-alpha=0.1 is not allowed"),
        (["--set", "fedrs-alpha=0.9"], "--set fedrs-alpha=0.9 is not allowed"),  # what the label fedrs-0.5 names
        (["--set", "seed=7"], "--set seed=7 is not allowed"),
    ],
)
def test_suite_in_process_refuses_options_that_would_loop_run_nothing_or_mislabel(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    """Each refused at once with one line and exit 2, nothing run or written: `--jobs 0` (it looped
    forever), a --set value no cell accepts (it ran nothing and exited 0), an export name that leaves
    results/ or replaces the claims file, a --set of what the cells' labels name."""
    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\nnum-supernodes: 5\nseeds: [0]\nout-dir: {tmp_path}\n"
        "base: {num-server-rounds: 1, partition: dirichlet}\n"
        "methods: {fedavg: {}, fedrs-0.5: {method: fedrs, fedrs-alpha: 0.5}}\n"
    )
    done = run_benchmark("suite_in_process.py", str(suite), *args)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and needle in err[0], done.stderr[-2000:]
    assert not (ROOT.parent / "X.yaml").exists() and not (ROOT / "results" / "t-gpu.yaml").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["s.yaml"]


def test_suite_in_process_runs_cells_together_as_each_runs_alone(tmp_path: Path, small_data: str) -> None:
    """`--set engine=batched`: a cell's child runs the batched engine; `--together 2`: two batched
    cells of other seeds in one process, their clients stacked across cells (`fedskew.batched.many`),
    write what each writes in a process of its own (float64, `assert_float64_runs_match`); without
    engine=batched the option is refused."""
    from tests.harness import assert_float64_runs_match

    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\nnum-supernodes: 10\nseeds: [0, 1]\nout-dir: {tmp_path}\n"
        "base: {num-server-rounds: 2, model: mlp, fraction-train: 0.3, compute-dtype: float64,"
        f" data-root: {small_data}}}\n"
        "methods: {fedavg: {}}\n"
    )
    common = ("--set", "engine=batched", "local-epochs=1")
    together = run_benchmark("suite_in_process.py", str(suite), *common, "--together", "2", "--tag", "together")
    assert together.returncode == 0, together.stderr[-3000:]
    assert "2 cells of s, 2 a process" in together.stdout, together.stdout
    alone = run_benchmark("suite_in_process.py", str(suite), *common, "--jobs", "2", "--tag", "alone")
    assert alone.returncode == 0, alone.stderr[-3000:]
    for seed in (0, 1):
        name = run_name("default", "fedavg", seed)
        assert_float64_runs_match(tmp_path / "s-together" / name, tmp_path / "s-alone" / name, 2)
        assert json.loads((tmp_path / "s-alone" / name / "config.json").read_text())["engine"] == "batched"
    refused = run_benchmark("suite_in_process.py", str(suite), "--together", "2", "--tag", "flower")
    assert refused.returncode == 2 and "--together runs cells on the batched engine" in refused.stderr, refused.stderr


def test_grid_compare_pairs_the_shared_seeds_and_leaves_other_budgets_apart(tmp_path: Path) -> None:
    """`grid.py compare` (the GPU script's last step): a cell whose paired gap's interval holds 0 is
    within the spread, one 10 points off on every seed is not, one of another budget is not compared."""
    import numpy as np

    from fedskew.reports.resultfile import CellResult, ResultSet, Stat, dump_results

    def cell(method: str, values: list[float], rounds: int = 40) -> CellResult:
        stat = Stat(float(np.mean(values)), float(np.std(values)), values)
        return CellResult("c2", method, [0, 1, 2], {"global.last10": stat}, rounds=rounds)

    ref = [cell("fedavg", [60.0, 50.0, 70.0]), cell("fedrs", [61.0, 52.0, 69.0]), cell("moon", [55.0, 56.0, 57.0])]
    ours = [cell("fedavg", [60.5, 49.0, 70.2]), cell("fedrs", [71.0, 62.0, 79.0]), cell("moon", [10.0] * 3, 2)]
    dump_results(ResultSet("ref", "s", "suites/s.yaml", ref), tmp_path / "ref.yaml")
    dump_results(ResultSet("ours", "s", "suites/s.yaml", ours), tmp_path / "ours.yaml")
    res = run_benchmark("grid.py", "compare", str(tmp_path / "ours.yaml"), str(tmp_path / "ref.yaml"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line for line in res.stdout.splitlines() if line.startswith("| c2/")}
    assert rows["c2/fedavg"].endswith("| yes |") and rows["c2/fedrs"].endswith("| no |"), res.stdout
    assert "not comparable: 2 rounds against 40" in rows["c2/moon"], res.stdout
    assert "1 of 2 cells within the reference's spread (global.last10); 1 cells of another budget" in res.stdout


def test_convergence_finds_where_a_curve_flattens_and_blocks_see_through_the_scatter(monkeypatch) -> None:
    """A curve climbing 0.2 points a round to round 100, then flat at 70: its last-10 mean is within
    0.5 of 70 from round 103 (69.58) and has moved less than 0.5 over the 50 rounds before 153; its
    50-round means are 55.1, 65.1, then 70, so by blocks it settles at 200. The same curve with
    rounds scattered by 3 points never passes the literal test (its last-10 means scatter by about
    1), while its 50-round means (scatter about 0.4) settle within the flat part."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import convergence

    climb = [min(0.5 + 0.002 * r, 0.7) for r in range(1, 301)]
    assert convergence.converged_round(climb) == 153
    assert convergence.block_means(climb) == pytest.approx([55.1, 65.1, 70.0, 70.0, 70.0, 70.0])
    assert convergence.settled_round(climb) == 200
    noisy = [a + 0.03 * e for a, e in zip(climb, np.random.default_rng(0).standard_normal(300), strict=True)]
    assert convergence.converged_round(noisy) is None
    assert convergence.settled_round(noisy) in (200, 250, 300)
    lines = convergence.table({"climb": climb, "noisy": noisy}, 10, 50, 0.5)
    assert convergence.trend_round(climb) == 300  # the slope of 65.1, 70, 70, 70 is 1.5 a block; then 0
    assert lines[2].startswith("| climb | 300 | 153 | 200 | 300 | 55.1, 65.1, 70.0")
    row = next(line for line in lines if line.startswith("| 101-150 | 2 |"))  # the last climbing block
    low, high = (float(v) for v in row.split("[")[1].rstrip(" |]").split(", "))
    assert 4.0 < low < high < 6.0  # +4.9 on both runs: an interval above 0
    budget = next(line for line in lines if line.startswith("Budget covering every run"))
    assert budget.startswith("Budget covering every run: literal 1 of 2 runs not within their rounds; by blocks 200")
    # blocks that scatter by 2 points about a flat line never pass one against the next, while their
    # slope over 4 blocks is 0.4 a block; a climb of 2 a block with one chance pair (62, 62.2) passes
    # block against block at 150 rounds, never by trend (slopes 1.2-2.0)

    def curve(blocks: list[float]) -> list[float]:
        return [b / 100 for b in blocks for _ in range(50)]

    flat = curve([69.0, 71.0] * 4)
    assert (convergence.settled_round(flat), convergence.trend_round(flat)) == (None, 200)
    climbing = curve([60.0, 62.0, 62.2, 64.0, 66.0, 68.0])
    assert (convergence.settled_round(climbing), convergence.trend_round(climbing)) == (150, None)


def test_convergence_writes_its_tables_into_the_named_block_of_a_page(tmp_path: Path) -> None:
    """`--doc F --block NAME`: the tables and the command (with `--block`) go into F's block NAME; the
    page's other block (another budget's runs) is left as it was."""
    for name, level in (("a--fedavg--s0", 0.6), ("a--fedrs--s0", 0.7)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        rows = [{"round": r, "global-accuracy": level} for r in range(1, 101)]
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "note.md"
    page.write_text(
        "<!-- report:convergence begin -->\nthe 300-round runs\n<!-- report:convergence end -->\n"
        "<!-- report:long begin -->\nold\n<!-- report:long end -->\n"
    )
    runs = sorted(str(p) for p in (tmp_path / "runs").iterdir())
    res = run_benchmark("convergence.py", *runs, "--doc", str(page), "--block", "long")
    assert res.returncode == 0, res.stderr[-2000:]
    text = page.read_text()
    assert "the 300-round runs" in text and "\nold\n" not in text
    assert f"benchmarks/convergence.py {tmp_path / 'runs'}/* --block long --doc {page}" in text, text
    assert "| a--fedrs--s0 | 100 | 60 | 100 | not within the run | 70.0, 70.0 |" in text, (
        text
    )  # flat: from round 10 + 50
    # one of a folder's two runs: the command names it (a glob would read the other again)
    res = run_benchmark("convergence.py", runs[0], "--doc", str(page), "--block", "long")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"benchmarks/convergence.py {runs[0]} --block long" in page.read_text()
    # a folder in a checkout's outputs/: named from there on, as any checkout holds it
    kept = tmp_path / "outputs" / "suites" / "s" / "a--fedavg--s0"
    kept.mkdir(parents=True)
    (kept / "metrics.jsonl").write_text((tmp_path / "runs" / "a--fedavg--s0" / "metrics.jsonl").read_text())
    res = run_benchmark("convergence.py", str(kept), "--doc", str(page), "--block", "long")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "benchmarks/convergence.py outputs/suites/s/* --block long" in page.read_text()


def test_convergence_classes_show_each_class_at_the_leaderboards_rounds_and_at_the_runs_end(
    tmp_path: Path, monkeypatch
) -> None:
    """`--classes`: a run whose class 1 climbs from 0.2 (rounds 1-40) to 0.9 (rounds 41-100) while
    class 0 stays at 0.5 reads 50 20 over rounds 31-40 and 50 90 over its last 50 rounds; a run
    without per-class records reads '-'; the option reaches the page's command."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import convergence

    rows = [
        {"round": r, "global-accuracy": 0.5, "global-per-class-accuracy": [0.5, 0.2 if r <= 40 else 0.9]}
        for r in range(1, 101)
    ]
    assert convergence.class_means(rows, 31, 40) == pytest.approx([50.0, 20.0])
    assert convergence.class_means(rows, 101, 150) is None
    bare = [{"round": r, "global-accuracy": 0.5} for r in range(1, 101)]
    lines = convergence.class_table({"a": rows, "b": bare}, 40, 50)
    assert lines[2:] == ["| a | 100 | 50 20 | 50 90 |", "| b | 100 | - | - |"]
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "note.md"
    page.write_text("<!-- report:convergence begin -->\n<!-- report:convergence end -->\n")
    res = run_benchmark("convergence.py", str(tmp_path / "runs" / "a"), "--classes", "--doc", str(page))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| a | 100 | 50 20 | 50 90 |" in page.read_text() and "--classes --doc" in page.read_text()


def test_convergence_reads_the_metric_named_and_refuses_one_a_run_lacks(tmp_path: Path) -> None:
    """`--metric personalized-pooled-accuracy`: the blocks are that accuracy's, not the global one's,
    the page says which and its command repeats the option; a run without the metric is refused by name."""
    run = tmp_path / "runs" / "a--fedrod--s0"
    run.mkdir(parents=True)
    rows = [
        {"round": r, "global-accuracy": 0.5, "personalized-pooled-accuracy": 0.9 + 0.01 * (r > 10)}
        for r in range(1, 21)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "note.md"
    page.write_text("<!-- report:p begin -->\n<!-- report:p end -->\n")
    res = run_benchmark(
        "convergence.py",
        str(run),
        "--window",
        "10",
        "--metric",
        "personalized-pooled-accuracy",
        "--doc",
        str(page),
        "--block",
        "p",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = page.read_text()
    assert "Metric: `personalized-pooled-accuracy`." in text and "| 90.0, 91.0 |" in text, text
    assert "--window 10 --metric personalized-pooled-accuracy --block p" in text, text
    res = run_benchmark("convergence.py", str(run), "--metric", "personalized-accuracy")
    assert res.returncode != 0 and "--metric personalized-accuracy: no round of a--fedrod--s0 records it" in res.stderr


def test_peer_split_replays_pfllib_s_loop_and_scores_a_prior_as_bayes_does(monkeypatch) -> None:
    """The replay equals PFLlib's `separate_data` "dir" loop as written (numpy's global generator,
    seeded) on labels small enough to redraw, and keeps every image once; a client of one class
    scores 1 under any classifier, two equal classes under an uninformative one 1/2, and a perfect
    classifier 1 whatever the prior."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import peer_split

    labels = np.random.default_rng(3).integers(0, 10, 2000)

    def theirs(dataset_label: np.ndarray, num_clients: int = 20, alpha: float = 0.1, least: int = 40) -> list:
        np.random.seed(1)  # their loop, names and all (dataset_utils.py at b9565b0c)
        min_size, K, N = 0, 10, len(dataset_label)
        while min_size < least:
            idx_batch = [[] for _ in range(num_clients)]
            for k in range(K):
                idx_k = np.where(dataset_label == k)[0]
                np.random.shuffle(idx_k)
                proportions = np.random.dirichlet(np.repeat(alpha, num_clients))
                proportions = np.array(
                    [p * (len(idx_j) < N / num_clients) for p, idx_j in zip(proportions, idx_batch, strict=True)]
                )
                proportions = proportions / proportions.sum()
                proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
                idx_batch = [
                    idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions), strict=True)
                ]
                min_size = min([len(idx_j) for idx_j in idx_batch])
        return [np.bincount(dataset_label[b], minlength=K) for b in idx_batch]

    counts = peer_split.pfllib_dirichlet_counts(labels, least=40)
    np.testing.assert_array_equal(counts, np.array(theirs(labels)))
    np.testing.assert_array_equal(counts.sum(0), np.bincount(labels, minlength=10))
    assert counts.sum(1).min() >= 40
    y = np.repeat(np.arange(10), 5)
    flat = np.zeros((50, 10))
    one, two = np.eye(10)[[3]] * 7, np.array([[4, 4, 0, 0, 0, 0, 0, 0, 0, 0]])
    assert peer_split.prior_adjusted_accuracy(flat, y, one) == 1.0
    assert peer_split.prior_adjusted_accuracy(flat, y, two) == 0.5  # the tie goes to class 0
    assert peer_split.prior_adjusted_accuracy(np.log(np.eye(10)[y] + 1e-9), y, np.vstack([one, two])) == 1.0
    assert peer_split.concentration(np.vstack([one, two])) == pytest.approx((11 / 15, np.exp(8 / 15 * np.log(2))))
