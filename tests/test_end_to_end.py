"""Real `flwr run` simulations of the baselines (a few clients, a couple of rounds)."""

from __future__ import annotations

import pytest

from tests.conftest import SMALL_JOB, read_metrics

pytestmark = pytest.mark.slow


def test_fedrs_learns_and_writes_results(flwr_job) -> None:
    """A real `flwr run` (FedAvg's own runs through it in the other end-to-end, deployment and
    careless-user tests): fedrs also evaluates its clients' personalized models on the central test
    set: with 2 classes each, they are right on their own classes and wrong on the 8 others."""
    job = {"method": "fedrs", "num-server-rounds": 3, "personalized-central-eval": True}
    summary, run_dir = flwr_job(job, num_supernodes=5, name="fedrs")
    assert summary["method"] == "fedrs" and summary["rounds"] == 3
    assert summary["final_personalized_accuracy"] > 0.8  # 2 classes per client: far above 0.5
    assert summary["best_global_accuracy"] > 0.3  # 10 classes: chance is 0.1
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(len(r["global-per-class-accuracy"]) == 10 for r in rows)
    for f in ("config.json", "timings.jsonl", "model.pt", "accuracy.png", "partition.png", "partition.txt"):
        assert (run_dir / f).is_file(), f
    assert (run_dir / "per-class.png").is_file() and list(run_dir.glob("events.out.tfevents.*"))
    held, missing = summary["last10_personalized_held_accuracy"], summary["last10_personalized_missing_accuracy"]
    assert held > 0.8 > 0.2 > missing


def test_same_seed_gives_identical_metrics_sequential_parallel_or_in_process(
    flwr_job, small_data, monkeypatch, tmp_path
) -> None:
    """One client at a time, or the 3 sampled clients of a round trained at once (3 Ray actors, in
    whatever order they finish): the same metrics, to the last digit. The first run's ServerApp
    runs in a fork of fedskew's warm executor, the second's in Flower's own fresh `flwr-simulation`.
    And `tests.harness.run_in_process` (what `benchmarks/suite_in_process.py` runs where Ray is not
    installed, e.g. on the GPU machine) serves the same partitions, samples the same clients and so
    writes the same metrics as `flwr run`'s simulation for a seed, to the last digit."""
    from flwr.supercore.task_identity import TaskIdentity

    from tests.harness import run_in_process

    job = {"method": "fedprox", "fraction-train": 0.6, "num-server-rounds": 2, "seed": 3}
    _, a = flwr_job(job, num_supernodes=5, name="a", actors=1)
    monkeypatch.setenv("FEDSKEW_WARM_EXEC", "0")
    _, b = flwr_job(job, num_supernodes=5, name="b", actors=3)
    assert (a / "metrics.jsonl").read_text() == (b / "metrics.jsonl").read_text()
    assert "personalized-held-accuracy" not in read_metrics(a)[-1]  # only with personalized-central-eval
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1  # messages built in this process
    out = tmp_path / "in-process"
    run_in_process({**SMALL_JOB, **job, "data-root": small_data, "out-dir": str(out), "run-name": "r"}, 5)
    assert (out / "r" / "metrics.jsonl").read_text() == (a / "metrics.jsonl").read_text()
