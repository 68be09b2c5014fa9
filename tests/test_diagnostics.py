"""What label skew breaks, class by class: the per-class record of the global model (against hand
computations), the partition's skew, the per-class files of a run, TensorBoard's copy of the metrics
and the Weights & Biases hook (with a stand-in module: nothing is ever sent)."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.diagnostics import (
    balanced_accuracy,
    class_holders,
    class_metrics,
    frequency_groups,
    held_and_missing_accuracy,
    last_rounds_per_class,
    per_class_accuracy,
    weight_norms,
    worst_class,
)
from fedskew.partitions import class_counts, dirichlet, iid, partition_skew
from fedskew.server_app.results import round_statistics
from fedskew.training import confusion, evaluate, processor

CPU = torch.device("cpu")


class Lookup(nn.Module):
    """Predicts `pred[i]` for the input holding index i (one-hot logits scaled by 5)."""

    def __init__(self, pred: list[int], num_classes: int) -> None:
        super().__init__()
        self.logits = 5.0 * torch.eye(num_classes)[torch.tensor(pred)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x[:, 0].long()]


def run_confusion(y: list[int], pred: list[int], num_classes: int, batch_size: int = 5):
    x = torch.arange(len(y)).float().unsqueeze(1)
    return confusion(Lookup(pred, num_classes), x, torch.tensor(y), batch_size, CPU)


# ---------------------------------------------------------------------------------------------- accuracy
def test_per_class_balanced_and_worst_class_against_a_hand_computed_confusion_matrix() -> None:
    # class 0: 4 images, one taken for class 1; class 1: 2 images, one taken for 2; class 2: 6, one for 0
    y = [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2]
    pred = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 0]
    _, cm = run_confusion(y, pred, 3)  # batches of 5: the counts add up over batches
    assert cm.tolist() == [[3, 1, 0], [0, 1, 1], [1, 0, 5]]
    acc = per_class_accuracy(cm)
    assert acc == pytest.approx([3 / 4, 1 / 2, 5 / 6])
    assert balanced_accuracy(acc) == pytest.approx((3 / 4 + 1 / 2 + 5 / 6) / 3)  # 0.694, not 9/12 = 0.75
    assert worst_class(acc) == (1, 0.5)
    _, plain = evaluate(Lookup(pred, 3), torch.arange(12).float().unsqueeze(1), torch.tensor(y), 5, CPU)
    assert plain == 9 / 12  # the plain accuracy is the trace of the same matrix


def test_a_test_set_lacking_a_class_reports_it_absent_not_zero() -> None:
    y = [0, 0, 2, 2, 2]  # no image of class 1, but the model predicts it twice
    _, cm = run_confusion(y, [0, 1, 2, 1, 2], 3)
    record = class_metrics(cm)
    assert record["global-per-class-accuracy"] == [0.5, None, pytest.approx(2 / 3)]
    assert record["global-balanced-accuracy"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert record["global-worst-class"] == 0  # class 1 is not the worst: it is not measured
    assert json.loads(json.dumps(record))["global-per-class-accuracy"][1] is None  # null in metrics.jsonl
    assert worst_class([None, None]) is None and balanced_accuracy([None]) is None


def test_ties_give_the_smallest_class() -> None:
    assert worst_class([0.5, 0.2, 0.2, 0.9]) == (1, 0.2)


# ---------------------------------------------------------------------------------------------- long tail
def test_head_middle_tail_on_a_constructed_long_tail() -> None:
    """Imbalance factor 100 over 10 classes, with the classes shuffled: the three most frequent are
    the head, the three rarest the tail, whatever their ids."""
    sizes = [int(6000 * 100 ** (-i / 9)) for i in range(10)]  # 6000 ... 60
    ids = np.random.default_rng(0).permutation(10)
    counts = np.zeros(10, dtype=int)
    counts[ids] = sizes
    groups = frequency_groups(counts)
    assert groups == {"head": sorted(ids[:3]), "middle": sorted(ids[3:7]), "tail": sorted(ids[7:])}
    acc = [float(c) / 10 for c in range(10)]  # class c: accuracy c / 10
    cm = np.zeros((10, 10), dtype=int)
    for c, a in enumerate(acc):
        cm[c, c], cm[c, (c + 1) % 10] = round(100 * a), 100 - round(100 * a)
    record = class_metrics(cm, groups)
    for name in ("head", "middle", "tail"):
        assert record[f"global-{name}-accuracy"] == pytest.approx(np.mean([acc[c] for c in groups[name]]))
    assert frequency_groups(np.full(10, 600)) is None  # balanced: no tail
    assert frequency_groups(np.array([4801, 4803, 4803, 4800])) is None  # a Dirichlet split of a balanced set
    assert frequency_groups(np.array([100, 60, 51, 51])) is None  # max / min < 2
    assert frequency_groups(np.array([100, 60, 51, 50])) == {"head": [0], "middle": [1, 2], "tail": [3]}


def test_the_group_sizes_are_thirds_of_the_classes() -> None:
    for c in (3, 10, 100):
        groups = frequency_groups(np.arange(c, 0, -1) * 10)
        k = round(c / 3)
        assert [len(groups[g]) for g in ("head", "middle", "tail")] == [k, c - 2 * k, k]
        assert groups["head"] == list(range(k)) and groups["tail"] == list(range(c - k, c))


# ---------------------------------------------------------------------------------------------- geometry
def test_classifier_norms_of_a_splitnet_and_of_fedgela_s_adapted_etf() -> None:
    from fedskew.losses.fedgela import ETFNet, make_etf
    from fedskew.models import build_model

    net = build_model("mlp", "fashion-mnist")
    with torch.no_grad():
        net.classifier.weight[2] = 0.0
        net.classifier.weight[3] = 3.0
    norms = weight_norms(net.class_weights().detach().numpy())
    assert norms[2] == 0.0 and norms[3] == pytest.approx(3.0 * math.sqrt(net.feature_dim))
    phi = torch.linspace(0.0, 1.0, 10)
    etf = ETFNet(nn.Identity(), make_etf(12, 10, 0), scale=7.0, phi=phi)
    assert weight_norms(etf.class_weights().numpy()) == pytest.approx((7.0 * phi).tolist(), abs=1e-5)
    x = torch.randn(4, 12)
    assert torch.allclose(etf(x), nn.functional.normalize(x, dim=1) @ etf.class_weights().T, atol=1e-5)


def test_class_holders_count_the_round_s_clients_with_a_class() -> None:
    counts = np.array([[5, 0, 0], [1, 2, 0], [0, 0, 9]])
    assert class_holders(counts, [0, 1]) == [2, 1, 0]
    assert class_holders(counts, [2]) == [0, 0, 1]


def test_held_and_missing_accuracy_of_a_client_with_known_classes() -> None:
    cm = np.diag([8, 6, 0, 1]) + np.array([[0, 2, 0, 0], [4, 0, 0, 0], [0, 10, 0, 0], [0, 0, 0, 0]])
    # per class: 0.8, 0.6, 0.0, 1.0; the client holds classes 0 and 3
    held, missing = held_and_missing_accuracy(cm, np.array([True, False, False, True]))
    assert held == pytest.approx(0.9) and missing == pytest.approx(0.3)
    assert held_and_missing_accuracy(cm, np.ones(4, bool))[1] is None  # it lacks nothing


# ---------------------------------------------------------------------------------------------- partition
def test_partition_skew_against_hand_computation() -> None:
    counts = np.array([[9, 0], [1, 10]])  # global mix (1/2, 1/2)
    skew = partition_skew(counts)
    assert skew["classes-per-client"] == {"mean": 1.5, "min": 1, "max": 2}
    tv = [0.5, 0.5 * (abs(1 / 11 - 0.5) + abs(10 / 11 - 0.5))]
    assert skew["label-distance"]["mean"] == pytest.approx(np.mean(tv))
    assert skew["label-distance"]["max"] == pytest.approx(0.5)
    # class 0: 90 % on client 0, not more than 90 %; class 1: all on client 1
    assert skew["dominated-classes"] == [{"class": 1, "client": 1, "share": 1.0}]


def test_partition_skew_grows_as_dirichlet_alpha_shrinks() -> None:
    labels = np.repeat(np.arange(10), 300)
    tvs = []
    for alpha in (100.0, 1.0, 0.1):
        counts = class_counts(labels, dirichlet(labels, 10, alpha, np.random.default_rng(3)), 10)
        tvs.append(partition_skew(counts)["label-distance"]["mean"])
    assert tvs[0] < 0.1 < tvs[1] < tvs[2]
    flat = partition_skew(class_counts(labels, iid(labels, 10, np.random.default_rng(0)), 10))
    assert flat["dominated-classes"] == [] and flat["classes-per-client"]["min"] == 10


# ---------------------------------------------------------------------------------------------- summary
def test_last_rounds_per_class_and_the_worst_class_of_the_mean() -> None:
    rows = [
        {"round": 1, "global-per-class-accuracy": [0.0, 0.0, None]},
        {"round": 2, "global-per-class-accuracy": [0.9, 0.2, None]},
        {"round": 3, "global-per-class-accuracy": [0.1, 0.4, None]},
        {"round": 4},  # not evaluated
    ]
    assert last_rounds_per_class(rows, "global-per-class-accuracy", 3) == pytest.approx([0.5, 0.3, None])
    stats = round_statistics(rows, last=3)
    assert stats["last3_worst_class"] == 1  # the worst single round (round 3) would say class 0
    assert last_rounds_per_class([{"round": 1}], "global-per-class-accuracy", 3) is None


def test_round_line_shows_balanced_and_worst_class() -> None:
    from fedskew.server_app.app import round_line

    g = {"global-accuracy": 0.7, "global-balanced-accuracy": 0.65, "global-worst-class": 6}
    line = round_line(3, 20, 1.5, {**g, "global-worst-class-accuracy": 0.0}, {"replies": 10})
    assert "global acc 0.7000 (balanced 0.6500, worst class 6 0.0000)" in line
    assert "global acc 0.7000 |" in round_line(3, 20, 1.5, {"global-accuracy": 0.7}, {})


# ---------------------------------------------------------------------------------------------- a run
@pytest.fixture(scope="module")
def long_tail_run(tmp_path_factory):
    """A real run in process (ServerApp and ClientApp) on a long tail, its central test set without
    class 3."""
    from flwr.supercore.task_identity import TaskIdentity

    import fedskew.server_app.app as server
    from tests.harness import run_in_process

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    load = server.load_test_set

    def without_class_3(cfg):
        x, y = load(cfg)
        keep = y != 3
        return x[keep], y[keep]

    out = tmp_path_factory.mktemp("runs")
    over = {
        "model": "mlp",
        "num-server-rounds": 3,
        "fraction-train": 0.5,
        "partition": "long-tail",
        "imbalance-factor": 20.0,
        "dirichlet-alpha": 0.1,
        "out-dir": str(out),
        "run-name": "r",
    }
    mp = pytest.MonkeyPatch()
    mp.setattr(server, "load_test_set", without_class_3)
    try:
        run_in_process(over, 6)
    finally:
        mp.undo()
    return out / "r"


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_records_every_class_and_reports_the_missing_test_class_absent(long_tail_run) -> None:
    rows, summary = rows_of(long_tail_run), json.loads((long_tail_run / "summary.json").read_text())
    part = json.loads((long_tail_run / "partition.json").read_text())
    groups, train = part["frequency-groups"], np.array(part["train"])
    assert groups == frequency_groups(train.sum(0)) and groups["head"] == [0, 1, 2]  # the profile's order
    for row in rows:
        acc = row["global-per-class-accuracy"]
        assert len(acc) == 10 and acc[3] is None and all(a is not None for c, a in enumerate(acc) if c != 3)
        assert row["global-balanced-accuracy"] == pytest.approx(np.mean([a for a in acc if a is not None]))
        assert row["global-worst-class"] != 3
        assert row["global-tail-accuracy"] == pytest.approx(np.mean([acc[c] for c in groups["tail"]]))
        assert row["global-middle-accuracy"] == pytest.approx(np.mean([acc[c] for c in groups["middle"] if c != 3]))
        assert row["class-holders"] == class_holders(train, row["partitions"])
        assert len(row["global-classifier-norms"]) == 10
    assert summary["test_absent_classes"] == [3] and summary["last10_per_class_accuracy"][3] is None
    assert summary["last10_global_balanced_accuracy"] == pytest.approx(
        np.mean([r["global-balanced-accuracy"] for r in rows])
    )
    assert summary["dominated_classes"] == part["skew"]["dominated-classes"]
    # what ran its arithmetic: this CPU with torch's vector kernels (a result file pairs seeds by it)
    assert summary["processor"] == processor(torch.device("cpu")) and summary["processor"].endswith(")")
    assert "classes held > 90 % by one client" in (long_tail_run / "partition.txt").read_text()
    assert (long_tail_run / "per-class.png").stat().st_size > 5000


def test_the_event_files_hold_the_metrics_of_metrics_jsonl(long_tail_run) -> None:
    """TensorBoard's own reader finds every number of every metrics.jsonl line (per-class lists as
    one scalar per class) at the round's step, the partition's skew at step 0 and the heatmap."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedskew.server_app.tracking import scalars

    events = EventAccumulator(str(long_tail_run), size_guidance={"scalars": 0, "images": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    rows = rows_of(long_tail_run)
    expected = {(tag, row["round"]): value for row in rows for tag, value in scalars(row).items()}
    assert {"global-accuracy", "global-balanced-accuracy", "global-per-class-accuracy/9", "class-holders/0"} <= tags
    assert "global-per-class-accuracy/3" not in tags  # absent: no point, not a 0
    got = {
        (tag, e.step): e.value
        for tag in tags - {t for t in tags if t.startswith("partition/")}
        for e in events.Scalars(tag)
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # float32 in the event file
    skew = json.loads((long_tail_run / "partition.json").read_text())["skew"]
    assert events.Scalars("partition/label-distance")[0].value == pytest.approx(skew["label-distance"]["mean"])
    image = events.Images("per-class-accuracy")
    assert len(image) == 1 and image[0].step == 3 and image[0].width > 100


# ---------------------------------------------------------------------------------------------- W&B
def test_wandb_logs_the_same_scalars_when_asked_and_is_skipped_when_missing(tmp_path, monkeypatch, caplog) -> None:
    from fedskew.server_app.tracking import Trackers

    calls: list = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", dict(values), step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or FakeRun(), Image=lambda f: f)
    cfg = {"tensorboard": False, "wandb-project": "skew"}
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trackers = Trackers(cfg, tmp_path / "run-a", 1)
    trackers.log_round({"round": 2, "global-accuracy": 0.5, "global-per-class-accuracy": [0.25, None], "x": None})
    trackers.close()
    assert calls[0] == ("init", {"project": "skew", "name": "run-a", "dir": str(tmp_path / "run-a"), "config": cfg})
    assert calls[1] == ("log", {"global-accuracy": 0.5, "global-per-class-accuracy/0": 0.25}, 2)
    assert calls[2] == ("finish",)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` raises ImportError
    with caplog.at_level("WARNING", logger="flwr.fedskew"):
        trackers = Trackers(cfg, tmp_path / "run-b", 1)
    assert trackers.wandb is None and "wandb is not installed" in caplog.text
    trackers.log_round({"round": 1, "global-accuracy": 0.5})  # nothing to log to, no error
    trackers.close()


@pytest.mark.parametrize("failing", ["init", "log", "finish", "tensorboard", "add_scalar", "close"])
def test_a_tracker_that_raises_never_costs_the_run(tmp_path, monkeypatch, caplog, failing: str) -> None:
    """W&B's init (no API key, no terminal), log or finish raising, or TensorBoard's writer failing:
    one warning naming the tracker, that tracker off, every other call and the other tracker go on."""
    import torch.utils.tensorboard

    from fedskew.server_app.tracking import Trackers

    calls: list = []

    def boom(*a, **k):
        calls.append(("raised", failing))
        raise RuntimeError(f"{failing} failed\nwith a second line")

    class FakeRun:
        log = boom if failing == "log" else lambda self, values, step: calls.append(("log", step))
        finish = boom if failing == "finish" else lambda self: calls.append(("finish",))

    init = boom if failing == "init" else lambda **kw: FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Image=lambda f: f))
    writer_class = torch.utils.tensorboard.SummaryWriter
    if failing == "tensorboard":
        monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", boom)
    elif failing in ("add_scalar", "close"):
        monkeypatch.setattr(writer_class, failing, boom)
    cfg = {"tensorboard": True, "wandb-project": "skew"}
    with caplog.at_level("WARNING", logger="flwr.fedskew"):
        trackers = Trackers(cfg, tmp_path / "run", 1)
        for r in (1, 2, 3):
            trackers.log_round({"round": r, "global-accuracy": 0.5})
        trackers.close()
    warned = [r.getMessage() for r in caplog.records if "goes on without it" in r.getMessage()]
    tracker = "tensorboard" if failing in ("tensorboard", "add_scalar", "close") else "wandb"
    assert len(warned) == 1 and warned[0].startswith(f"fedskew: {tracker} failed (RuntimeError: {failing} failed)")
    assert calls.count(("raised", failing)) == 1  # off after its first error
    if tracker == "tensorboard":  # W&B went on
        assert [c for c in calls if c[0] == "log"] == [("log", 1), ("log", 2), ("log", 3)] and ("finish",) in calls


# ---------------------------------------------------------------------------------------------- screening
@pytest.mark.parametrize(
    ("central_eval", "metrics", "needle"),
    [
        (True, {"personal-missing-accuracy": [0.1] * 10}, "not of kind float"),  # a per-class list
        (True, {"global-per-class-accuracy": [0.9] * 10}, "unexpected metrics"),  # the server's own key
        (True, {"personal-held-accuracy": 1.5}, "outside [0, 1]"),
        (True, {"personal-held-accuracy": float("nan")}, "outside [0, 1]"),
        (False, {"personal-held-accuracy": 0.5}, "unexpected metrics"),  # not asked for: not declared
    ],
)
def test_a_client_claiming_per_class_values_is_screened(task_identity, central_eval, metrics, needle) -> None:
    """Real replies of 3 clients (evaluating their personalized models centrally when asked); one of
    them is replaced by a reply with hostile per-class metrics: it is a counted failure, and the
    round's metrics are those of the round in which that client sent nothing."""
    import copy

    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedskew.config import validate
    from fedskew.strategies.fedavg import FedAvgStrategy
    from tests.harness import InProcessGrid, app_defaults

    over = {"model": "mlp", "partition": "classes-per-client", "fraction-train": 1.0, "eval-every": 100}
    cfg = {**app_defaults(), **over, "personalized-central-eval": central_eval}
    grid = InProcessGrid(3, cfg, num_partitions=10)
    strategy = FedAvgStrategy(validate(cfg))
    requests = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord({"attempt": 0}), grid))
    contents = [r.content for r in grid.send_and_receive(requests)]
    assert all(("personal-held-accuracy" in c["metrics"]) == central_eval for c in contents)
    hostile = RecordDict(dict(contents[1].items()))
    hostile["metrics"] = MetricRecord({**dict(contents[1]["metrics"]), **metrics})
    honest_only = copy.deepcopy(strategy)

    def replies(bad: RecordDict | None) -> list[Message]:
        chosen = [contents[0], bad, contents[2]]
        return [Message(RecordDict(dict(c.items())), reply_to=q) for c, q in zip(chosen, requests, strict=True) if c]

    got = strategy.aggregate_train(1, replies(hostile))[1]
    want = honest_only.aggregate_train(1, replies(None))[1]
    assert len(strategy.failures) == 1 and needle in strategy.failures[0]["reason"]
    keys = ("personalized-held-accuracy", "personalized-missing-accuracy", "personalized-accuracy", "replies")
    assert {k: got.get(k) for k in keys} == {k: want.get(k) for k in keys}
    if central_eval:
        assert 0.0 <= want["personalized-missing-accuracy"] <= want["personalized-held-accuracy"] <= 1.0


def test_fedskew_config_lists_the_diagnostics_keys(capsys) -> None:
    from fedskew import cli

    assert cli.main(["config"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "per-class record" in lines["class-metrics"] and "True" in lines["class-metrics"]
    assert "classes it holds" in lines["personalized-central-eval"] and "False" in lines["personalized-central-eval"]
    assert "TensorBoard" in lines["tensorboard"] and "Weights & Biases" in lines["wandb-project"]


def test_the_trackers_keys_change_no_result_but_the_per_class_record_does() -> None:
    """A run saved with TensorBoard off or a W&B project is the same computation (a suite does not
    call it changed, its results hash the same); one without the per-class record is not."""
    from fedskew.config import validate
    from fedskew.reports.resultfile import config_sha256
    from fedskew.server_app.results import config_changes, saved_config
    from tests.harness import app_defaults

    cfg = validate(app_defaults())
    quiet = saved_config({**cfg, "tensorboard": False, "wandb-project": "p"})
    assert config_changes(quiet, cfg) == []
    assert config_sha256(quiet) == config_sha256(saved_config(cfg))
    assert config_changes(saved_config({**cfg, "class-metrics": False}), cfg) == ["class-metrics"]


def test_only_the_keys_a_method_reads_make_its_run_one_of_another_config() -> None:
    """A FedRoD run saved when MAP's aggregation default was another is the same computation; MAP's
    own key changes a MAP run, and FedRS's keys change a MAP run too (MAP's trainer is FedRS's)."""
    from fedskew.config import validate
    from fedskew.registry import METHODS, config_keys
    from fedskew.server_app.results import config_changes, saved_config
    from tests.harness import app_defaults

    fedrod = validate({**app_defaults(), "method": "fedrod"})
    assert config_changes(saved_config({**fedrod, "map-uniform-aggregation": False}), fedrod) == []
    assert config_changes(saved_config({**fedrod, "fedrod-gamma": 0.5}), fedrod) == ["fedrod-gamma"]
    mapcfg = validate({**app_defaults(), "method": "map"})
    assert config_changes(saved_config({**mapcfg, "map-uniform-aggregation": False}), mapcfg) == [
        "map-uniform-aggregation"
    ]
    assert "fedrs-alpha" in config_keys(METHODS["map"]) and "fedrs-alpha" not in config_keys(METHODS["fedrod"])
    assert config_changes(saved_config({**mapcfg, "fedrs-alpha": 0.1}), mapcfg) == ["fedrs-alpha"]
