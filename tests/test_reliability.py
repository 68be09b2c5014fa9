"""Failures, bad payloads, retries, checkpoints and resume, through the real ServerApp and ClientApp
run in process (tests/harness.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, RecordDict

from tests.harness import run_in_process

BASE = {"model": "mlp", "num-server-rounds": 3, "fraction-train": 0.3, "run-name": "r", "partition": "iid"}


def raise_error(msg: Message, reply: Message) -> Message:
    return Message(Error(code=0, reason="RuntimeError: injected client crash"), reply_to=msg)


def with_arrays(edit):
    def fault(msg: Message, reply: Message) -> Message:
        arrays = {k: v.clone() for k, v in reply.content["arrays"].to_torch_state_dict().items()}
        edit(arrays)
        return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": reply.content["metrics"]}), reply_to=msg)

    return fault


def nan_weights(arrays: dict) -> None:
    arrays["classifier.weight"][0, 0] = float("nan")


def wrong_shape(arrays: dict) -> None:
    arrays["classifier.weight"] = torch.zeros(3, 3)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sampled(run_dir, r: int) -> list[int]:
    return rows(run_dir / "metrics.jsonl")[r - 1]["partitions"]


@pytest.fixture
def job(tmp_path, task_identity):
    def run(faults=None, **overrides):
        cfg = {**BASE, "out-dir": str(tmp_path), **overrides}
        run_in_process(cfg, 10, faults)
        return tmp_path / cfg["run-name"]

    return run


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """An undisturbed 4-round run: which partitions each round samples, and its metrics."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    out = tmp_path_factory.mktemp("ref")
    run_in_process({**BASE, "out-dir": str(out), "run-name": "full", "num-server-rounds": 4, "checkpoint-every": 2}, 10)
    return out / "full"


def test_bad_replies_never_reach_the_model_and_are_logged(job, ref) -> None:
    p2, p3 = sampled(ref, 2), sampled(ref, 3)
    faults = {(p2[0], 2): raise_error, (p3[0], 3): with_arrays(nan_weights), (p3[1], 3): with_arrays(wrong_shape)}
    run_dir = job(faults)
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["failures"] for m in metrics] == [0, 1, 2]
    assert [m["replies"] for m in metrics] == [3, 2, 1]
    lost = rows(run_dir / "failures.jsonl")
    assert [(f["round"], f["partition"]) for f in lost] == [(2, p2[0]), (3, p3[0]), (3, p3[1])]
    assert "injected client crash" in lost[0]["reason"]
    assert "NaN" in lost[1]["reason"] and "expected" in lost[2]["reason"]
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in model.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_global_accuracy"] > 0.5


def test_too_few_replies_retries_then_stops_with_the_reason(job, ref, tmp_path) -> None:
    faults = {(p, 2): raise_error for p in sampled(ref, 2)}
    with pytest.raises(RuntimeError, match=r"round 2: only 0 usable replies \(min-replies=1\) after 2 attempts"):
        job(faults)
    lost = rows(tmp_path / BASE["run-name"] / "failures.jsonl")  # written although the run stopped
    assert sorted((f["round"], f["attempt"]) for f in lost) == [(2, 0)] * 3 + [(2, 1)] * 3
    assert all("injected client crash" in f["reason"] for f in lost)
    # the stop itself is recorded (the export counts such a run, over the rounds before it)
    stopped = json.loads((tmp_path / BASE["run-name"] / "stopped.json").read_text())
    assert stopped["round"] == 2 and "only 0 usable replies" in stopped["reason"]
    assert stopped["method-revision"] == 0 and stopped["device"] == "cpu"
    assert len(rows(tmp_path / BASE["run-name"] / "metrics.jsonl")) == 1


def test_dropped_reply_counts_as_lost_node(job, ref) -> None:
    run_dir = job({(sampled(ref, 1)[0], 1): lambda msg, reply: None}, **{"num-server-rounds": 1})
    lost = rows(run_dir / "failures.jsonl")
    assert len(lost) == 1 and "no reply within round-timeout" in lost[0]["reason"]


def test_resume_ends_with_the_same_metrics_as_an_uninterrupted_run(job, ref, tmp_path) -> None:
    full = ref
    crash = {(p, 3): raise_error for p in sampled(full, 3)}
    with pytest.raises(RuntimeError):
        job(crash, **{"run-name": "cut", "num-server-rounds": 4, "checkpoint-every": 2, "round-retries": 0})
    cut = tmp_path / "cut"
    assert len(rows(cut / "metrics.jsonl")) == 2 and not (cut / "summary.json").exists()
    assert json.loads((cut / "stopped.json").read_text())["round"] == 3
    job(**{"run-name": "cut", "num-server-rounds": 4, "checkpoint-every": 2, "resume": True})
    assert not (cut / "stopped.json").exists()  # set aside: the resumed run did not stop
    assert [json.loads(p.read_text())["round"] for p in cut.glob("aside-*/stopped.json")] == [3]
    assert (cut / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(cut / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert np.isclose(
        json.loads((cut / "summary.json").read_text())["final_global_accuracy"],
        json.loads((full / "summary.json").read_text())["final_global_accuracy"],
    )


@pytest.mark.parametrize(
    "over",
    [
        {"method": "fedmr"},  # server state: the global prototypes
        {"method": "mupfl", "model": "lenet", "fraction-train": 0.5, "mupfl-init": "personal"},  # w~_i, h_glo
    ],
    ids=["fedmr", "mupfl"],
)
def test_resume_restores_the_strategy_state(job, tmp_path, over: dict) -> None:
    over = {**over, "num-server-rounds": 2, "checkpoint-every": 1}  # resumed from round 1's checkpoint
    full = job(**over, **{"run-name": "full"})
    crash = {(p, 2): raise_error for p in sampled(full, 2)}
    with pytest.raises(RuntimeError):
        job(crash, **over, **{"run-name": "cut", "round-retries": 0})
    job(**over, **{"run-name": "cut", "resume": True})
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_central_evaluation_runs_beside_the_next_rounds_training(job, monkeypatch) -> None:
    """Round r's evaluation overlaps round r + 1's training, and the records stay in round order
    with round r's own accuracy."""
    import threading
    import time

    import fedskew.server_app.app as server

    spans: dict[str, list[tuple[float, float]]] = {"eval": [], "train": []}
    confusion, train_round = server.confusion, server.train_round

    def slow_confusion(*args, **kwargs):
        t = time.perf_counter()
        time.sleep(0.3)  # a central evaluation longer than a round's training
        result = confusion(*args, **kwargs)
        spans["eval"].append((t, time.perf_counter()))
        assert threading.current_thread() is not threading.main_thread()
        return result

    seen_before_next_round_ended = []

    def timed_train_round(strategy, grid, r, *args, **kwargs):
        t = time.perf_counter()
        result = train_round(strategy, grid, r, *args, **kwargs)
        if r > 1:  # round r - 1's record reaches the disk while round r still trains (it does not lag)
            done = run_dir_of(strategy) / "metrics.jsonl"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(rows(done) if done.exists() else []) < r - 1:
                time.sleep(0.01)
            seen_before_next_round_ended.append(len(rows(done)) == r - 1)
        spans["train"].append((t, time.perf_counter()))
        return result

    def run_dir_of(strategy):
        return Path(strategy.cfg["out-dir"]) / strategy.cfg["run-name"]

    monkeypatch.setattr(server, "confusion", slow_confusion)
    monkeypatch.setattr(server, "train_round", timed_train_round)
    run_dir = job(**{"run-name": "overlap", "num-server-rounds": 3, "checkpoint-every": 1, "plots": True})
    assert seen_before_next_round_ended == [True, True]
    ev, tr = spans["eval"], spans["train"]
    for r in (1, 2):  # round r's evaluation while round r + 1 trains (lists are 0-based)
        assert ev[r - 1][0] < tr[r][1] and tr[r][0] < ev[r - 1][1]
    metrics, timings = rows(run_dir / "metrics.jsonl"), rows(run_dir / "timings.jsonl")
    assert [m["round"] for m in metrics] == [t["round"] for t in timings] == [1, 2, 3]
    assert all(m["global-accuracy"] is not None for m in metrics)
    assert all(t["eval-seconds"] >= 0.3 for t in timings)
    wall = timings[-1]["started-at"] + timings[-1]["seconds"] - timings[0]["started-at"]
    assert sum(t["seconds"] for t in timings) == pytest.approx(wall, abs=0.05)  # rounds tile the loop
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["round"] == 3 and ckpt["global-accuracy"] == metrics[-1]["global-accuracy"]
    assert (run_dir / "partition.png").is_file()  # drawn in the background while round 1 trained


def test_the_partition_picture_is_drawn_beside_round_one_and_its_failure_is_only_a_warning(
    job, monkeypatch, caplog
) -> None:
    import threading

    import fedskew.server_app.app as server

    drawn = []

    def plot(counts, path, title):
        drawn.append(threading.current_thread() is threading.main_thread())
        raise OSError("disk full")

    monkeypatch.setattr(server, "plot_counts", plot)
    run_dir = job(**{"run-name": "picture", "num-server-rounds": 1, "plots": True})
    assert drawn == [False]  # in the background thread
    assert (run_dir / "summary.json").is_file() and (run_dir / "partition.json").is_file()
    assert "partition.png not written: disk full" in caplog.text


def test_a_resumed_run_s_event_files_show_each_round_once(job) -> None:
    """Stopped in round 4 after the checkpoint of round 2 (round 3 was written, then cut back): the
    resumed run's event file purges round 3 of the first attempt, so TensorBoard's reader sees every
    round once, with the values of metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    over = {
        "num-server-rounds": 4,
        "checkpoint-every": 2,
        "round-retries": 0,
        "fraction-train": 1.0,
        "tensorboard": True,
    }
    crash = {(p, 4): raise_error for p in range(10)}
    with pytest.raises(RuntimeError):
        job(crash, **over)
    run_dir = job(**over, resume=True)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(run_dir)).Reload()
    got = [(e.step, e.value) for e in events.Scalars("global-accuracy")]
    want = [(m["round"], m["global-accuracy"]) for m in rows(run_dir / "metrics.jsonl")]
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
