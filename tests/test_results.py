"""Run statistics: final, best and last-10-round means of the tracked accuracies."""

from __future__ import annotations

import json

import pytest

from fedskew.server_app.results import round_statistics


def test_round_statistics_final_best_and_last_rounds_mean() -> None:
    rows = [{"round": r, "global-accuracy": r / 100, "personalized-accuracy": 0.5} for r in range(1, 26)]
    rows[-1]["personalized-accuracy"] = None  # no client had a test split in the last round
    rows[20]["global-accuracy"] = None  # eval-every: round 21 not evaluated centrally
    s = round_statistics(rows, last=10)
    assert s["final_global_accuracy"] == 0.25 and s["best_global_accuracy"] == 0.25
    assert s["last10_global_accuracy"] == pytest.approx(sum(r for r in range(16, 26) if r != 21) / 9 / 100)
    assert s["final_personalized_accuracy"] is None and s["last10_personalized_accuracy"] == 0.5
    assert s["final_client_global_accuracy"] is None and s["last10_client_global_accuracy"] is None


def test_round_statistics_ignores_non_finite_values_and_handles_no_rows() -> None:
    rows = [{"round": 1, "global-accuracy": float("nan")}, {"round": 2, "global-accuracy": 0.4}]
    s = round_statistics(rows, last=10)
    assert s["last10_global_accuracy"] == 0.4 and s["best_global_accuracy"] == 0.4
    assert all(v is None for v in round_statistics([]).values())


def test_mupfl_cluster_starts_are_tracked_and_exported_as_their_own_statistic() -> None:
    """Under `mupfl-init="cluster"` the model the paper evaluates is the returning client's start after
    PKCF's fine-tune (`pkcf-accuracy`): its last-k mean is a statistic a result file can hold."""
    from fedskew.reports.resultfile import cell_stats, describe_stat

    rows = [{"round": r, "start-accuracy": 0.6, "pkcf-accuracy": 0.5 + r / 100} for r in range(1, 21)]
    runs = [round_statistics(rows, last=10), round_statistics([{**r, "pkcf-accuracy": 0.9} for r in rows], last=10)]
    assert runs[0]["last10_pkcf_accuracy"] == pytest.approx(0.5 + 15.5 / 100)
    stats = cell_stats(runs, [0, 1], 10)
    assert stats["mupfl-pkcf.last10"].per_seed == [65.5, 90.0] and stats["mupfl-start.last10"].mean == 60.0
    words = describe_stat("mupfl-pkcf.last10")
    assert words.startswith("MuPFL's returning-client start after PKCF's fine-tune accuracy")
    assert "mupfl-pkcf.last10" not in cell_stats([round_statistics([{"round": 1, "global-accuracy": 0.5}])], [0], 10)


def test_every_result_file_metric_is_a_tracked_accuracy() -> None:
    """A result file's metric names a `round_statistics` key; one whose accuracy `TRACKED` does not
    hold would be silently absent from every export."""
    from fedskew.reports.resultfile import METRICS
    from fedskew.server_app.results import TRACKED

    rows = [{"round": 1, **{key: 0.5 for key in TRACKED}}]
    stats = round_statistics(rows, last=1)
    for metric, key in METRICS.items():
        assert key.replace("_", "-") in TRACKED, metric
        assert stats[f"last1_{key}"] == 0.5, metric


def test_a_run_records_client_global_accuracy_and_last_rounds_means(tmp_path, task_identity) -> None:
    """Through the real ServerApp and ClientApp (in process): every round has the clients' mean
    client-global accuracy, and summary.json's statistics are those of metrics.jsonl."""
    from fedskew.server_app.results import read_jsonl
    from tests.harness import run_in_process

    over = {"model": "mlp", "num-server-rounds": 3, "fraction-train": 0.5, "partition": "iid"}
    run_in_process({**over, "out-dir": str(tmp_path), "run-name": "r"}, 4)
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert all(0.0 <= row["client-global-accuracy"] <= 1.0 for row in rows)
    assert rows[0]["client-global-accuracy"] < 0.3  # round 1: the untrained initial model
    assert rows[-1]["client-global-accuracy"] > 0.6  # iid: round 2's global model is already good
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert {k: summary[k] for k in round_statistics(rows)} == round_statistics(rows)


def test_plots_and_tensorboard_false_write_no_picture_and_no_event_file_and_the_same_metrics(
    tmp_path, task_identity
) -> None:
    """`plots` draws accuracy.png, per-class.png and partition.png, `tensorboard` the event files;
    off, none of them is written and every other file of the run holds the same numbers."""
    from tests.harness import run_in_process

    over = {"model": "mlp", "num-server-rounds": 2, "partition": "iid", "out-dir": str(tmp_path)}
    pictures = {"accuracy.png", "per-class.png", "partition.png"}
    run_in_process({**over, "run-name": "on", "plots": True, "tensorboard": True}, 3)
    run_in_process({**over, "run-name": "off", "plots": False, "tensorboard": False}, 3)
    on, off = ({p.name for p in (tmp_path / name).iterdir()} for name in ("on", "off"))
    assert pictures <= on and any(n.startswith("events.out.tfevents.") for n in on)
    assert on - off == pictures | {n for n in on if n.startswith("events.out.tfevents.")}
    assert off <= on
    assert (tmp_path / "on" / "metrics.jsonl").read_text() == (tmp_path / "off" / "metrics.jsonl").read_text()


def test_accuracy_plot_shows_client_global_accuracy_on_integer_rounds(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from fedskew.server_app.results import plot_accuracy

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    rows = [
        {"round": r, "global-accuracy": 0.1 * r, "client-global-accuracy": 0.2, "personalized-accuracy": 0.9}
        for r in (1, 2, 3)
    ]
    plot_accuracy(rows, tmp_path / "a.png", "fedavg")
    ax = closed[0].axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["global", "client-global", "personalized"]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert (tmp_path / "a.png").is_file()
