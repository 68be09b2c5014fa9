"""Who writes what: a full disk never leaves half a results file, two writers never share a
run folder or a result file, an export refuses rounds two writers interleaved, an out-dir that cannot
be made fails up front naming the key, a resume stays on its engine and the batched engine's log
holds no colour codes in a pipe."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedskew import cli
from fedskew.config import ConfigError
from fedskew.files import lock_path, locked
from fedskew.reports.resultfile import export_suite, load_results
from fedskew.run.experiments import load_suite
from tests.harness import ROOT, app_defaults
from tests.test_careless import one_line_exit_2, stopped_run
from tests.test_report import SUITE, fake_run


@pytest.fixture
def sleeper():
    """Another live process of this host (the holder of a lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def hold(target: Path, pid: int, host: str | None = None) -> Path:
    """A lock of `target` as process `pid` (on `host`, default this one) left it."""
    import socket

    lock = lock_path(target)
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host or socket.gethostname(), "since": "2025-01-01T00:00:00+00:00"}
    lock.write_text(json.dumps({**holder, "command": "suite_in_process.py s.yaml --into-suite", "token": "x"}))
    return lock


def suite_with_runs(tmp_path: Path):
    path = tmp_path / "t.yaml"
    path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(path, app_defaults())
    for cell in suite.cells:
        fake_run(suite, cell, [0.5, 0.6, 0.7])
    return path, suite


# ---------------------------------------------------------------------------------------------- 3: atomic writes
FULL_DISK = """
import resource, signal, sys

def full_disk():
    \"\"\"From now on a write past 600 bytes fails with EFBIG (SIGXFSZ ignored), as on a full disk.\"\"\"
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))

exec(sys.argv[1])
"""


def on_a_full_disk(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a child process; it calls `full_disk()` once its imports are done."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", FULL_DISK, code], capture_output=True, text=True, env=env, cwd=ROOT)


def digest(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_export_that_fails_mid_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    """The disk fills while an export writes: the export fails loudly, the result file is the one
    before it, byte for byte, no temporary file is left, and the next export writes every cell (it
    did not read back a file cut at 600 bytes and keep what was left of it)."""
    suite_path, suite = suite_with_runs(tmp_path)
    results = tmp_path / "results"
    path = export_suite(suite, "suites/t.yaml", app_defaults(), results)
    before = path.read_bytes()
    assert len(before) > 1000 and len(load_results(path).cells) == 2
    for cell in suite.cells:  # new runs to export: the file changes
        (suite.folder / cell.run_name / "metrics.jsonl").write_text(
            "".join(json.dumps({"round": r, "global-accuracy": 0.3}) + "\n" for r in (1, 2, 3))
        )
    full = on_a_full_disk(
        "from fedskew.run.experiments import load_suite\nfrom fedskew.reports.resultfile import export_suite\n"
        f"from tests.harness import app_defaults\nsuite = load_suite({str(suite_path)!r}, app_defaults())\n"
        f"full_disk()\nexport_suite(suite, 'suites/t.yaml', app_defaults(), {str(results)!r})"
    )
    assert full.returncode != 0 and "File too large" in full.stderr, full.stderr[-2000:]
    assert path.read_bytes() == before
    assert sorted(p.name for p in results.iterdir()) == ["t.yaml"]  # no temporary file, no lock left
    again = load_results(export_suite(suite, "suites/t.yaml", app_defaults(), results))
    assert len(again.cells) == 2 and again.cells[0].stats["global.final"].mean == 30.0


def test_a_suite_report_and_the_docs_that_fail_mid_write_are_left_as_they_were(tmp_path: Path) -> None:
    """The same full disk under a suite's results.md / results.csv and under `fedskew report`'s docs
    and figures: every file is the one before, whole."""
    from fedskew.run import experiments
    from tests.test_report import copy_inputs

    suite_path, suite = suite_with_runs(tmp_path)
    experiments.write_report(suite)
    before = digest(suite.folder)
    full = on_a_full_disk(
        "from fedskew.run.experiments import load_suite, write_report\nfrom tests.harness import app_defaults\n"
        f"suite = load_suite({str(suite_path)!r}, app_defaults())\nfull_disk()\nwrite_report(suite)"
    )
    assert full.returncode != 0 and "File too large" in full.stderr, full.stderr[-2000:]
    assert digest(suite.folder) == before
    root = copy_inputs(tmp_path / "checkout")
    (root / "docs" / "img").mkdir(parents=True)
    for name in ("docs/results.md", "docs/leaderboard.md", "docs/img/claims.png", "docs/img/leaderboard-gain.png"):
        (root / name).write_text("the committed one\n")
    before = digest(root / "docs") | {"README.md": (root / "README.md").read_bytes()}
    full = on_a_full_disk(f"from fedskew.reports.report import main\nfull_disk()\nmain(['--root', {str(root)!r}])")
    assert "File too large" in full.stderr, full.stderr[-2000:]
    assert digest(root / "docs") | {"README.md": (root / "README.md").read_bytes()} == before


# ---------------------------------------------------------------------------------------------- 4: one writer
def test_a_second_writer_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path, sleeper) -> None:
    target = tmp_path / "suite" / "cell"
    hold(target, sleeper.pid)
    with pytest.raises(ConfigError) as refused, locked([target]):
        pass
    line = str(refused.value)
    assert f"pid {sleeper.pid} on " in line and "since 2025-01-01" in line and "--into-suite" in line
    assert "\n" not in line and str(lock_path(target)) in line
    sleeper.kill()
    sleeper.wait()
    with pytest.warns(UserWarning, match=f"taking over the stale lock of pid {sleeper.pid}"), locked([target]):
        mine = json.loads(lock_path(target).read_text())
        assert mine["pid"] == os.getpid()
    assert not lock_path(target).exists()  # released
    hold(target, 1, host="another-host")  # another host's pid is not ours to judge: refused
    with pytest.raises(ConfigError, match="on another-host"), locked([target]):
        pass


def test_locks_are_all_or_none_and_a_waiting_writer_gets_the_lock_when_it_is_released(tmp_path, sleeper) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    hold(b, sleeper.pid)
    with pytest.raises(ConfigError, match="in use by"), locked([a, b]):
        pass
    assert not lock_path(a).exists()  # a was released when b was refused
    lock_path(b).unlink()
    t0 = time.monotonic()
    with locked([a]):
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from fedskew.files import locked\nwith locked([{str(a)!r}], wait=30): print('got it')",
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        assert child.poll() is None  # waiting
    out, _ = child.communicate(timeout=60)
    assert out.strip() == "got it" and time.monotonic() - t0 < 60


def test_fedskew_experiment_and_fedskew_run_refuse_a_run_folder_another_writer_holds(
    tmp_path, capsys, sleeper, monkeypatch
) -> None:
    """Before anything is planned or started: `fedskew experiment` (a cell another process writes),
    `fedskew run` into a folder another process writes; both one line naming the holder, exit 2."""
    path = tmp_path / "t.yaml"
    path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(path, app_defaults())
    hold(suite.folder / suite.cells[1].run_name, sleeper.pid)
    started: list = []
    monkeypatch.setattr("fedskew.run.experiments.plan_cells", lambda *a, **k: started.append(a) or [])
    line = one_line_exit_2(capsys, ["experiment", str(path)])
    assert suite.cells[1].run_name in line and f"in use by pid {sleeper.pid}" in line and started == []
    assert not lock_path(suite.folder / suite.cells[0].run_name).exists()
    monkeypatch.setattr(cli, "run_simulation", lambda *a, **k: started.append(a) or {})
    run_dir = tmp_path / "runs" / "r"
    hold(run_dir, sleeper.pid)
    out = f'out-dir="{run_dir.parent}" run-name="r" model="mlp"'
    line = one_line_exit_2(capsys, ["run", "-n", "5", "-c", out])
    assert f"{run_dir} is in use by pid {sleeper.pid}" in line and started == []


def test_suite_in_process_into_suite_refuses_a_cell_another_writer_holds(tmp_path, sleeper) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(SUITE.format(out=tmp_path / "out"))
    suite = load_suite(path, app_defaults())
    hold(suite.folder / suite.cells[0].run_name, sleeper.pid)
    script = ROOT / "benchmarks" / "suite_in_process.py"
    done = subprocess.run(
        [sys.executable, str(script), str(path), "--into-suite"], capture_output=True, text=True, cwd=ROOT
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and f"in use by pid {sleeper.pid}" in err[0], done.stderr
    assert not (suite.folder / suite.cells[0].run_name).exists()  # nothing started


@pytest.mark.parametrize("rounds", [[1, 1, 2, 2, 3, 3], [1, 2, 3, 1], [1, 3]])
def test_an_export_refuses_rounds_that_are_not_one_to_r_in_order(tmp_path, rounds: list[int]) -> None:
    """Two writers in one folder left 1,1,2,2,... (or 1,2,3,1): statistics over them would be wrong,
    so the export stops with one line naming the file and the first bad round, the file unchanged."""
    _, suite = suite_with_runs(tmp_path)
    metrics = suite.folder / suite.cells[1].run_name / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r, "global-accuracy": 0.5}) + "\n" for r in rounds))
    first_bad = next(i for i, r in enumerate(rounds, 1) if r != i)
    with pytest.raises(ConfigError) as refused:
        export_suite(suite, "suites/t.yaml", app_defaults(), tmp_path / "results")
    line = str(refused.value)
    assert str(metrics) in line and f"row {first_bad} holds round {rounds[first_bad - 1]}" in line
    assert "\n" not in line and not (tmp_path / "results" / "t.yaml").exists()


# ---------------------------------------------------------------------------------------------- 9: out-dir
def test_an_out_dir_that_cannot_be_created_fails_the_dry_run_naming_the_key(tmp_path, capsys) -> None:
    line = one_line_exit_2(capsys, ["run", "-n", "5", "-c", 'out-dir="/proc/x" model="mlp"'])
    assert line.startswith("fedskew: config error: out-dir: /proc/x") and "cannot be written" in line
    suite = tmp_path / "s.yaml"
    suite.write_text(SUITE.format(out="/proc/x"))
    line = one_line_exit_2(capsys, ["experiment", str(suite), "--dry-run"])
    assert "out-dir: /proc/x/t cannot be written" in line


# ---------------------------------------------------------------------------------------------- 13: engines
def test_a_resume_on_the_other_engine_is_refused(tmp_path, capsys) -> None:
    """The batched engine's float32 arithmetic rounds differently: a run is resumed on its own engine."""
    run_dir = tmp_path / "r"
    stopped_run(run_dir)
    line = one_line_exit_2(capsys, ["run", "--resume", str(run_dir), "--engine", "batched"])
    assert "engine='batched' does not match the checkpoint's engine='flower'" in line


def test_the_batched_engine_colours_its_log_only_on_a_terminal(tmp_path) -> None:
    """`fedskew run --engine batched` with its output in a pipe: Flower's level names without escape codes."""
    out = f'out-dir="{tmp_path}" run-name="r" model="mlp" num-server-rounds=1 fraction-train=0.4'
    done = subprocess.run(
        [sys.executable, "-m", "fedskew.cli", "run", "-n", "5", "--engine", "batched", "-c", out],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "FLWR_LOG_LEVEL": "INFO"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "INFO" in done.stdout + done.stderr and "\x1b[" not in done.stdout + done.stderr


def test_plain_log_keeps_the_colours_of_a_terminal_and_restores_the_handlers(monkeypatch) -> None:
    from flwr.common.logger import ConsoleHandler

    from fedskew.batched.grid import plain_log

    class Tty:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> None:
            pass

    handler = ConsoleHandler(stream=Tty())
    piped = ConsoleHandler(stream=open(os.devnull, "w"))
    for h in (handler, piped):
        logging.getLogger("flwr").addHandler(h)
    try:
        with plain_log():
            assert handler.colored and not piped.colored
        assert piped.colored  # as it was
    finally:
        for h in (handler, piped):
            logging.getLogger("flwr").removeHandler(h)
        piped.stream.close()
