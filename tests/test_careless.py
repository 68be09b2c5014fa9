"""A careless user or a damaged disk: nothing is lost, and what a run would refuse is refused up
front with one line. Reused run folders (overwrite, set aside), resume checks of every file it
reads, resource bounds and a teardown that needs no new process, suite names, labels and edits,
and the bounds of keys that allocate or loop by their value."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from fedskew import cli
from fedskew.config import ConfigError, validate
from fedskew.resources import plan_resources
from fedskew.run import experiments
from fedskew.run.launcher import _descendants, _running, prepare_config, stop_process_tree
from fedskew.server_app.results import RunOutput, quiet_strategy, read_jsonl, saved_config
from tests.harness import ROOT, InProcessGrid, app_defaults

pytestmark = pytest.mark.usefixtures("no_cuda")


@pytest.fixture
def no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_superlink(monkeypatch) -> list:
    """`fedskew run` records what it would submit instead of starting a SuperLink."""
    submitted: list = []
    monkeypatch.setattr(cli, "run_simulation", lambda app_dir, overrides, *a, **k: submitted.append(overrides) or {})
    monkeypatch.setattr(cli, "format_summary", lambda s: "summary")
    return submitted


def one_line_exit_2(capsys, argv: list[str]) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> SHA-256): to show that nothing changed."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def rows(*rounds: int) -> str:
    return "".join(json.dumps({"global-accuracy": 0.5, "round": r}, sort_keys=True) + "\n" for r in rounds)


# ---------------------------------------------------------------------- a reused run-name
def earlier_run(run_dir: Path) -> Path:
    """A finished run's results (what a reused run-name used to delete)."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(rows(1, 2))
    (run_dir / "summary.json").write_text('{"method": "fedavg"}')
    (run_dir / "checkpoint.pt").write_bytes(b"earlier checkpoint")
    (run_dir / "config.json").write_text("{}")
    return run_dir


def test_a_reused_run_name_is_refused_up_front_and_nothing_is_deleted(tmp_path, capsys, no_superlink) -> None:
    run_dir = earlier_run(tmp_path / "r")
    before = digest(run_dir)
    line = one_line_exit_2(capsys, ["run", "-n", "20", "-c", f'out-dir="{tmp_path}" run-name="r"'])
    assert str(run_dir) in line and "metrics.jsonl" in line and "--overwrite" in line and "--resume" in line
    assert digest(run_dir) == before and no_superlink == []
    assert cli.main(["run", "-n", "20", "--overwrite", "-c", f'out-dir="{tmp_path}" run-name="r"']) == 0
    assert no_superlink[0]["overwrite"] is True  # the ServerApp sets the earlier files aside (below)


def test_the_server_app_refuses_a_reused_folder_and_overwrite_sets_it_aside(tmp_path) -> None:
    run_dir = earlier_run(tmp_path / "r")
    before = digest(run_dir)
    cfg = validate({"out-dir": str(tmp_path), "run-name": "r"})
    with pytest.raises(ConfigError, match=r"holds an earlier run's metrics\.jsonl, summary\.json, checkpoint\.pt"):
        RunOutput(cfg, 1)
    assert digest(run_dir) == before
    RunOutput({**cfg, "overwrite": True}, 1)
    (aside,) = run_dir.glob("aside-*")
    kept = digest(aside)
    assert {name: kept[name] for name in before} == before  # every earlier file, byte for byte
    assert "overwrite" in (aside / "reason.txt").read_text()
    assert sorted(p.name for p in run_dir.iterdir()) == [aside.name, "config.json"]  # a fresh start
    assert json.loads((run_dir / "config.json").read_text())["overwrite"] is False  # saved as how it ran


def test_a_plain_flwr_run_with_a_reused_name_stops_before_any_message(tmp_path, task_identity) -> None:
    """The real ServerApp main (as `flwr run` starts it): refused before discovery, nothing deleted."""
    from fedskew.server_app.app import main

    run_dir = earlier_run(tmp_path / "r")
    before = digest(run_dir)
    cfg = {**app_defaults(), "out-dir": str(tmp_path), "run-name": "r", "model": "mlp"}
    grid = InProcessGrid(3, cfg)
    with pytest.raises(ConfigError, match="earlier run"):
        main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    assert grid.sent == [] and digest(run_dir) == before


# ---------------------------------------------------------------------- resume: every file checked first
def stopped_run(run_dir: Path, method: str = "fedavg", checkpoint_round: int = 2, **files: str) -> dict:
    """A run of `method` (MLP) stopped after round 3 with its checkpoint after `checkpoint_round`;
    `files` replace the per-round files. Returns its config."""
    cfg = validate({"out-dir": str(run_dir.parent), "run-name": run_dir.name, "model": "mlp", "method": method})
    run_dir.mkdir(parents=True)
    strategy = quiet_strategy(cfg)
    state = {
        "round": checkpoint_round,
        "arrays": strategy.initial_arrays().to_torch_state_dict(),
        "strategy": strategy.state_dict(),
        "metrics": {},
        "run": {"method": method, "model": "mlp", "dataset": cfg["dataset"]},  # as the ServerApp writes it
    }
    torch.save(state, run_dir / "checkpoint.pt")
    (run_dir / "config.json").write_text(json.dumps(saved_config(cfg)))
    (run_dir / "partition.json").write_text(json.dumps({"train": [[1]] * 20, "test": [[1]] * 20}))
    files = {"metrics.jsonl": rows(1, 2, 3), "timings.jsonl": rows(1, 2, 3), "failures.jsonl": rows(3), **files}
    for name, text in files.items():
        (run_dir / name.replace("_", ".")).write_text(text)
    return {**cfg, "resume": True}


def edit_checkpoint(run_dir: Path, edit) -> None:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    edit(state)
    torch.save(state, run_dir / "checkpoint.pt")


DAMAGE = {
    "a garbage line after round 1": (
        lambda d: (d / "metrics.jsonl").write_text(rows(1) + "garbage\n" + rows(2, 3)),
        "line 2",
    ),
    "a missing round": (lambda d: (d / "metrics.jsonl").write_text(rows(1, 3)), "rounds [1], not 1..2"),
    "timings not UTF-8": (lambda d: (d / "timings.jsonl").write_bytes(b"\xff\xfe" + rows(1).encode()), "not UTF-8"),
    "failures out of order": (lambda d: (d / "failures.jsonl").write_text(rows(2, 1)), "out of order"),
    "a checkpoint round of -5": (lambda d: edit_checkpoint(d, lambda s: s.update(round=-5)), "round=-5"),
    "a checkpoint after the last round": (lambda d: edit_checkpoint(d, lambda s: s.update(round=99)), "after round 99"),
    "a truncated checkpoint": (lambda d: (d / "checkpoint.pt").write_bytes(b"PK\x03\x04 cut"), "does not load"),
    "NaN in the model": (
        lambda d: edit_checkpoint(d, lambda s: s["arrays"]["classifier.weight"].fill_(float("nan"))),
        "NaN",
    ),
    "another model's arrays": (
        lambda d: edit_checkpoint(d, lambda s: s["arrays"].update({"classifier.weight": torch.zeros(3, 3)})),
        "does not fit",
    ),
    "config.json of another method": (
        lambda d: (d / "config.json").write_text(json.dumps({"method": "fedrs", "model": "mlp"})),
        "does not match the checkpoint's method=",
    ),
    "config.json of another model": (
        lambda d: (d / "config.json").write_text(json.dumps({"method": "fedavg", "model": "lenet"})),
        "does not match the checkpoint's model=",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_edited_run_folder_is_refused_before_anything_starts(
    tmp_path, capsys, no_superlink, damage: str
) -> None:
    """Both doors: `fedskew run --resume` (one line, exit 2, no SuperLink) and the ServerApp's own
    resume path (`flwr run` with resume=true); neither changes a byte of the folder."""
    run_dir = tmp_path / "r"
    cfg = stopped_run(run_dir)
    damage_it, needle = DAMAGE[damage]
    damage_it(run_dir)
    before = digest(run_dir)
    line = one_line_exit_2(capsys, ["run", "--resume", str(run_dir)])
    assert needle in line and no_superlink == [], line
    with pytest.raises(ConfigError, match=None) as info:
        RunOutput(cfg, 1).resume(quiet_strategy(cfg))
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert digest(run_dir) == before


def test_a_foreign_strategy_state_is_refused(tmp_path, capsys, no_superlink) -> None:
    run_dir = tmp_path / "r"
    stopped_run(run_dir, "fedmr")
    edit_checkpoint(run_dir, lambda s: s.update(strategy={"prototypes": "not a tensor"}))
    assert "strategy state does not load" in one_line_exit_2(capsys, ["run", "--resume", str(run_dir)])


def test_resume_cuts_only_rounds_after_the_checkpoint_and_a_torn_line_and_keeps_them_aside(tmp_path, capsys) -> None:
    run_dir = tmp_path / "r"
    torn = rows(1, 2, 3) + '{"global-accuracy": 0.5, "rou'  # a crash while round 4 was written
    cfg = stopped_run(run_dir, metrics_jsonl=torn)
    (run_dir / "summary.json").write_text('{"an": "earlier finish"}')
    before = digest(run_dir)
    prepare_config(ROOT, {**cfg, "out-dir": str(tmp_path)}, 20)  # the launcher accepts it
    assert digest(run_dir) == before  # and changes nothing
    out = RunOutput(cfg, 1)
    state = out.resume(quiet_strategy(cfg))
    assert state is not None and state["round"] == 2
    assert (run_dir / "metrics.jsonl").read_text() == rows(1, 2)
    assert (run_dir / "timings.jsonl").read_text() == rows(1, 2) and (run_dir / "failures.jsonl").read_text() == ""
    assert not (run_dir / "summary.json").exists()  # the run is not finished any more
    (aside,) = run_dir.glob("aside-*")
    kept = digest(aside)
    for name in ("metrics.jsonl", "timings.jsonl", "failures.jsonl", "summary.json"):
        assert kept[name] == before[name], name  # the originals, torn line included
    assert "resume after round 2" in (aside / "reason.txt").read_text()


def test_reports_skip_a_bad_line_instead_of_dropping_the_rest(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(1) + "garbage\n" + '["not", "a", "row"]\n' + rows(2, 3) + '{"round": 4, "glo')
    assert [r["round"] for r in read_jsonl(path)] == [1, 2, 3]


# ---------------------------------------------------------------------- resources and teardown
def test_threads_and_actors_are_bounded_by_the_cores(capsys, no_superlink, monkeypatch) -> None:
    with pytest.raises(
        ConfigError, match=r"torch-threads=1000000 is not allowed: must be at most 8 in a simulation \(4 x the 2 cores"
    ):
        plan_resources(1_000_000, cores=2, gpus=0)
    with pytest.raises(ConfigError, match="--actors 1000 is not allowed"):
        plan_resources(1, 1000, cores=2, gpus=0)
    assert plan_resources(1, 4, cores=2, gpus=0).actors == 4  # a few actors more than cores: allowed
    assert plan_resources(8, cores=2, gpus=0).threads == 8  # a larger machine's threads, reproduced
    monkeypatch.setattr("fedskew.resources.available_cores", lambda: 2)
    assert "torch-threads=1000000" in one_line_exit_2(capsys, ["run", "-c", "torch-threads=1000000"])
    assert "torch-threads=64" in one_line_exit_2(capsys, ["run", "-c", "torch-threads=64"])
    assert "--actors 9" in one_line_exit_2(capsys, ["run", "-j", "9"])
    assert no_superlink == []


def test_teardown_stops_a_process_tree_without_starting_a_process(monkeypatch) -> None:
    """With the process table full no new process can start: finding and stopping what a run
    started must not need one (it ran `ps`)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = list(_descendants(proc.pid))
    assert len(children) == 2 and all("sleep 60" in a for a in _descendants(proc.pid).values())

    def no_fork(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")  # what fork gives then

    monkeypatch.setattr(subprocess, "Popen", no_fork)
    try:
        stop_process_tree(proc, grace=5.0)
    finally:
        monkeypatch.undo()
        with contextlib.suppress(ProcessLookupError):
            for pid in children:
                subprocess.os.kill(pid, 9)
    deadline = time.monotonic() + 5
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode is not None and not any(map(_running, children))


# ---------------------------------------------------------------------- suites
BASE = "num-server-rounds: 3, partition: iid, model: mlp"


def write_suite(tmp_path: Path, **parts: str) -> Path:
    """A suite file of flow-style parts (name, out-dir, base, methods, partitions) over defaults."""
    parts = {
        "name": "t",
        "out-dir": str(tmp_path / "out"),
        "base": f"{{{BASE}}}",
        "methods": "{fedavg: {}}",
        "partitions": "{iid: {}}",
        **parts,
    }
    path = tmp_path / "suite.yaml"
    path.write_text("num-supernodes: 5\n" + "".join(f"{k}: {v}\n" for k, v in parts.items()))
    return path


@pytest.mark.parametrize(
    ("parts", "needle"),
    [
        ({"name": "../../X"}, "name='../../X' is not allowed"),
        ({"name": "/tmp/X"}, "name='/tmp/X' is not allowed"),
        ({"name": '""'}, "name='' is not allowed"),
        ({"base": "{null: 3}"}, "base: key None is not a run-config key"),
        ({"methods": "{fedavg: {3: 3}}"}, "methods.fedavg: key 3 is not a run-config key"),
        ({"methods": "{a/b: {method: fedavg}}"}, "methods label='a/b' is not allowed"),
        ({"partitions": "{..: {}}"}, "partitions label='..' is not allowed"),
        ({"out-dir": "{tmp}/file/sub"}, "is not a folder"),
        ({"out-dir": "{tmp}/file"}, "is not a folder"),
    ],
)
def test_suite_names_labels_and_out_dir_are_checked(tmp_path, parts: dict, needle: str) -> None:
    (tmp_path / "file").write_text("x")
    path = write_suite(tmp_path, **{k: v.replace("{tmp}", str(tmp_path)) for k, v in parts.items()})
    with pytest.raises(ConfigError) as info:
        experiments.load_suite(path, app_defaults())
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("extra", "flags", "needle"),
    [
        ('device: "cuda"', [], "CUDA is not available"),
        ("min-nodes: 6", [], "min-nodes=6 is not allowed: the simulation has 5 clients"),
        ("torch-threads: 1", ["-j", "1000"], "--actors 1000"),
    ],
)
def test_a_dry_run_refuses_what_the_run_would(
    tmp_path, capsys, monkeypatch, extra: str, flags: list, needle: str
) -> None:
    monkeypatch.setattr(experiments, "run_simulation", lambda *a, **k: pytest.fail("a cell ran"))
    path = write_suite(tmp_path, base=f"{{{BASE}, {extra}}}")
    assert needle in one_line_exit_2(capsys, ["experiment", str(path), "--dry-run", *flags])
    assert needle in one_line_exit_2(capsys, ["experiment", str(path), *flags])  # the run: refused up front


def fake_run_writing_config(calls: list):
    """A cell's simulation: its config.json (as the ServerApp saves it) and a summary."""

    def run(app_dir, overrides, n, **kwargs):
        calls.append(overrides)
        d = Path(overrides["out-dir"]) / overrides["run-name"]
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(saved_config(validate({**app_defaults(), **overrides}))))
        (d / "metrics.jsonl").write_text(rows(1, 2, 3))
        (d / "summary.json").write_text(json.dumps({"wall_seconds": 1.0}))
        return {}

    return run


def test_an_edited_suite_names_the_finished_cells_it_reuses_and_reruns_them_when_asked(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(experiments, "simulation_link", lambda app_dir, head, cluster: contextlib.nullcontext("link"))
    calls: list = []
    monkeypatch.setattr(experiments, "run_simulation", fake_run_writing_config(calls))
    path = write_suite(tmp_path, partitions="{iid: {}, c2: {partition: iid}}")
    assert cli.main(["experiment", str(path)]) == 0 and len(calls) == 2
    calls.clear()
    assert cli.main(["experiment", str(path)]) == 0 and calls == []  # unchanged: skipped, no warning
    assert "warning" not in capsys.readouterr().out

    write_suite(tmp_path, base=f"{{{BASE}, num-server-rounds: 4}}", partitions="{iid: {lr: 0.1}, c2: {partition: iid}}")
    assert cli.main(["experiment", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "iid--fedavg--s0 (5 clients): changed (changed: lr, num-server-rounds)" in out
    assert (
        "2 finished cell(s) were computed under another config" in out
        and "c2--fedavg--s0 (changed: num-server-rounds)" in out
    )
    assert cli.main(["experiment", str(path)]) == 0 and calls == []  # kept as they are, and said so
    assert "warning: 2 finished cell(s)" in capsys.readouterr().out
    assert cli.main(["experiment", str(path), "--rerun-changed"]) == 0
    assert sorted(c["run-name"] for c in calls) == ["c2--fedavg--s0", "iid--fedavg--s0"]
    assert all(c["overwrite"] is True for c in calls)  # the ServerApp sets their earlier files aside
    calls.clear()
    assert cli.main(["experiment", str(path)]) == 0 and calls == []  # now done under the new config


def test_a_stopped_cell_that_cannot_resume_runs_afresh_and_keeps_its_files(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(experiments, "simulation_link", lambda app_dir, head, cluster: contextlib.nullcontext("link"))
    calls: list = []
    monkeypatch.setattr(experiments, "run_simulation", fake_run_writing_config(calls))
    path = write_suite(tmp_path)
    suite = experiments.load_suite(path, app_defaults())
    run_dir = suite.folder / suite.cells[0].run_name
    cfg, _ = prepare_config(
        ROOT, {**suite.cells[0].overrides, "out-dir": str(suite.folder), "run-name": run_dir.name}, 5
    )
    stopped_run(run_dir, metrics_jsonl=rows(1) + "garbage\n" + rows(2))
    (run_dir / "config.json").write_text(json.dumps(saved_config(cfg)))
    (plan,) = experiments.plan_cells(suite, ROOT)
    assert plan.action == "afresh" and "line 2" in plan.note and plan.overrides["overwrite"] is True
    experiments.run_suite(suite, ROOT)
    assert "running afresh" in capsys.readouterr().out and calls[0]["overwrite"] is True


# ---------------------------------------------------------------------- late failures caught by validation
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"method": "mupfl", "mupfl-features-per-class": 10**9}, "mupfl-features-per-class=1000000000"),
        ({"method": "mupfl", "mupfl-tau": 10**9}, "mupfl-tau="),
        ({"method": "mupfl", "mupfl-match-iters": 10**9}, "mupfl-match-iters="),
        ({"method": "map", "map-personal-epochs": 10**9}, "map-personal-epochs="),
        ({"method": "map", "map-mmd-kernels": 10**9}, "map-mmd-kernels="),
        ({"local-epochs": 10**9}, "local-epochs="),
        ({"num-server-rounds": 10**12}, "num-server-rounds="),
        ({"round-retries": 10**9}, "round-retries="),
        ({"hf-image-size": 10**6}, "hf-image-size="),
        ({"torch-threads": 1_000_000}, "torch-threads=1000000"),
        ({"round-timeout": 1e-9}, "round-timeout=1e-09 is not allowed: must be a float in [1, inf)"),
        ({"map-sigma": 1e300}, "map-sigma=1e+300"),
        ({"device": "cuda:٣"}, "device='cuda:٣'"),
        ({"device": "cuda:128"}, "device='cuda:128'"),
        ({"device": "cuda:"}, "device='cuda:'"),
        ({"out-dir": "a\0b"}, "out-dir='a\\x00b' is not allowed: a path holds no NUL"),
        ({None: 3}, "None: unknown run-config key"),
    ],
)
def test_values_that_only_fail_late_are_refused_by_validation(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_paper_scale_values_stay_allowed() -> None:
    validate({"method": "mupfl", "mupfl-features-per-class": 200, "mupfl-tau": 100, "num-server-rounds": 1000})
    validate({"round-timeout": 1.0, "map-sigma": 0.3, "device": "cuda:7", "local-epochs": 20})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-n", "3", "-c", 'min-nodes=4 partition="iid"'], "min-nodes=4 is not allowed: the simulation has 3 clients"),
        (["-c", 'out-dir="{tmp}/file"'], "is not a folder"),
        (["-c", 'out-dir="{tmp}/file/sub"'], "is not a folder"),
        (
            ["-c", 'method="feddc" state-max-mb=0.2'],
            "state-max-mb=0.2 is below the 0.34 MB that each feddc client keeps (the drift h_i and the control "
            "variate c_i) with model='lenet': set state-max-mb >= 0.35",
        ),
    ],
)
def test_cli_refuses_late_failures_up_front(tmp_path, capsys, no_superlink, args: list, needle: str) -> None:
    (tmp_path / "file").write_text("x")
    assert needle in one_line_exit_2(capsys, ["run", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    assert no_superlink == []


@pytest.mark.parametrize("method", ["feddc", "moon"])
def test_the_smallest_state_max_mb_named_works_and_one_below_it_fails(tmp_path, task_identity, method) -> None:
    """The two methods that keep two model-sized copies: at the value the refusal names every round is
    answered, 0.01 MB below it every client fails once it holds both copies (as it would have, 30-68 s
    into a run, before the check)."""
    from fedskew.client_app.state import MB, kept_state_bytes, state_bound_problem
    from fedskew.server_app.app import RoundFailedError
    from tests.harness import run_in_process

    cfg = {"method": method, "model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 3}
    cfg.update({"eval-every": 3, "tensorboard": False, "out-dir": str(tmp_path), "num-partitions": 50})
    smallest = math.ceil(kept_state_bytes(validate({**app_defaults(), **cfg})) / MB * 100) / 100
    assert not state_bound_problem(validate({**app_defaults(), **cfg, "state-max-mb": smallest}))
    run_in_process({**cfg, "run-name": "fits", "state-max-mb": smallest}, 2, num_partitions=50)
    assert not (tmp_path / "fits" / "failures.jsonl").exists() or not read_jsonl(tmp_path / "fits" / "failures.jsonl")
    with pytest.raises(RoundFailedError):
        run_in_process({**cfg, "run-name": "short", "state-max-mb": smallest - 0.01}, 2, num_partitions=50)
    assert "StateTooLargeError" in (tmp_path / "short" / "failures.jsonl").read_text()


@pytest.mark.slow
def test_a_real_run_refuses_its_reused_name_and_overwrite_keeps_the_earlier_files_aside(flwr_job) -> None:
    """Through `flwr run`: the second start with the name is refused up front, and overwrite=true
    (which the run config must carry to the ServerApp) moves every file of the first run aside."""
    job = {"num-server-rounds": 1, "checkpoint-every": 1}
    _, run_dir = flwr_job(job, name="r")
    first = digest(run_dir)
    with pytest.raises(ConfigError, match="holds an earlier run's"):
        flwr_job(job, name="r")
    assert digest(run_dir) == first
    summary, _ = flwr_job({**job, "overwrite": True}, name="r")
    (aside,) = run_dir.glob("aside-*")
    kept = digest(aside)
    assert {name: kept[name] for name in first} == first and summary["rounds"] == 1
    assert {"summary.json", "metrics.jsonl", "checkpoint.pt"} <= {p.name for p in run_dir.iterdir()}


def _install_in(args: tuple[str, str]) -> str:
    from fedskew.run.launcher import install_fab

    return str(install_fab(Path(args[0]), Path(args[1])))


def test_runs_of_one_app_starting_together_each_find_its_fab_installed_whole(tmp_path) -> None:
    """Flower copies a FAB into its folder after creating it and skips a run whose folder exists:
    the launcher installs it first, renamed into place, so processes installing the same app at
    once all get one folder holding every file, named as Flower names it."""
    from concurrent.futures import ProcessPoolExecutor

    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab

    from tests.conftest import app_folder

    staged_app, home = app_folder(tmp_path), tmp_path / "home"
    with ProcessPoolExecutor(4) as pool:
        paths = set(pool.map(_install_in, [(str(staged_app), str(home))] * 4))
    assert len(paths) == 1
    installed = Path(paths.pop())
    with contextlib.redirect_stdout(None):
        flowers = install_from_fab(build_fab_from_disk(staged_app), install_dir=tmp_path / "flower", skip_prompt=True)
    assert installed.name == flowers.name and installed.parent == home / "apps"
    files = sorted(p.relative_to(flowers) for p in flowers.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(installed) for p in installed.rglob("*") if p.is_file())
    assert all((installed / f).read_bytes() == (flowers / f).read_bytes() for f in files)
    assert [p.name for p in (home / "apps").iterdir()] == [installed.name]  # no staging folder left


def test_a_failed_run_shows_the_app_logs_last_error(tmp_path) -> None:
    from fedskew.run.launcher import last_error

    log = tmp_path / "app.log"
    trace = "Traceback (most recent call last):\n  File x\nValueError: bad\n"
    log.write_text("INFO ok\n\x1b[91mERROR \x1b[0m: old\n" + trace)
    assert last_error(log) == "\nits last error:\n" + "\n".join("    " + line for line in trace.splitlines())
    assert last_error(log, 1) == "\nits last error:\n    Traceback (most recent call last):"
    assert last_error(tmp_path / "none.log") == ""
