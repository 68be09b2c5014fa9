"""The benchmark scripts run (`--quick`, tiny sizes) and print their ratios."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    ],
)
def test_benchmark_prints_its_ratios(script: str, expected: list[str]) -> None:
    res = run_benchmark(script, "--quick")
    assert res.returncode == 0, res.stderr[-3000:]
    for text in expected:
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
