"""FedAvgStrategy on hand-made replies: aggregation, screening, ordering, sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedskew.config import validate
from fedskew.strategies.aggregate import pooled_accuracy, summarize_clients, weighted_average
from fedskew.strategies.fedavg import FedAvgStrategy


class FakeGrid:
    """Answers `query.info` with partition ids; node ids are arbitrary."""

    def __init__(self, partitions: dict[int, int]) -> None:
        self.partitions = partitions

    def get_node_ids(self):
        return list(self.partitions)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            pid = self.partitions[m.metadata.dst_node_id]
            content = RecordDict({"info": ConfigRecord({"partition-id": pid, "num-partitions": len(self.partitions)})})
            reply = Message(content, reply_to=m)
            out.append(reply)
        return out


def make_reply(request: Message, arrays: dict[str, np.ndarray], n: int, pid: int, acc: float = 0.5) -> Message:
    metrics = MetricRecord(
        {"num-examples": n, "partition-id": pid, "personal-accuracy": acc, "train-loss": 1.0, "train-seconds": 0.1}
    )
    rec = ArrayRecord({k: torch.from_numpy(v) for k, v in arrays.items()})
    reply = Message(RecordDict({"arrays": rec, "metrics": metrics}), reply_to=request)
    return reply


@pytest.fixture
def setup(task_identity):
    # hand-made replies far from the model sent: the update bound is tested in test_hostile.py
    cfg = validate({"model": "mlp", "fraction-train": 1.0, "partition": "iid", "max-update-ratio": 0.0})
    strategy = FedAvgStrategy(cfg)
    grid = FakeGrid({111: 2, 222: 0, 333: 1})
    arrays = strategy.initial_arrays()
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    return strategy, arrays, msgs


def shaped_like(arrays: ArrayRecord, value: float) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, value, dtype=v.numpy().dtype) for k, v in arrays.items()}


def test_messages_carry_arrays_and_round(setup) -> None:
    strategy, _arrays, msgs = setup
    assert sorted(m.metadata.dst_node_id for m in msgs) == [111, 222, 333]
    assert all(m.content["config"]["server-round"] == 1 and m.metadata.message_type == MessageType.TRAIN for m in msgs)
    assert strategy.node_partitions == {111: 2, 222: 0, 333: 1}


def test_weighted_aggregation_of_replies(setup) -> None:
    strategy, arrays, msgs = setup
    replies = [
        make_reply(m, shaped_like(arrays, v), n, strategy.node_partitions[m.metadata.dst_node_id])
        for m, v, n in zip(msgs, (1.0, 2.0, 4.0), (1, 1, 2), strict=True)
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    for v in new.values():
        assert np.allclose(v.numpy(), (1.0 + 2.0 + 2 * 4.0) / 4)
    assert metrics["replies"] == 3 and metrics["failures"] == 0
    assert metrics["partitions"] == [0, 1, 2]  # sorted by partition id
    assert metrics["personalized-accuracy"] == pytest.approx(0.5)


def test_uniform_weights(setup) -> None:
    strategy, arrays, msgs = setup
    strategy.cfg = {**strategy.cfg, "aggregation-weights": "uniform"}
    replies = [
        make_reply(m, shaped_like(arrays, v), n, i)
        for i, (m, v, n) in enumerate(zip(msgs, (1.0, 2.0, 6.0), (1, 10, 100), strict=True))
    ]
    new, _ = strategy.aggregate_train(1, replies)
    assert all(np.allclose(v.numpy(), 3.0) for v in new.values())


def test_every_declared_client_metric_reaches_the_rounds_metrics(setup) -> None:
    """A metric the method's wire declares is logged as the client mean (over the replies that hold
    it) unless the strategy computes it itself; an undeclared one is refused with its reply."""
    from fedskew.records import NON_NEGATIVE
    from fedskew.wire import Wire

    class Declares(FedAvgStrategy):
        wire = Wire({"drift": NON_NEGATIVE, "own": NON_NEGATIVE, "rare": NON_NEGATIVE})

        def aggregate_extras(self, server_round, replies):
            return {"own": -1.0}

    strategy, arrays, msgs = setup
    strategy.__class__ = Declares
    replies = []
    for m, drift in zip(msgs, (1.0, 2.0, 6.0), strict=True):
        pid = strategy.node_partitions[m.metadata.dst_node_id]
        reply = make_reply(m, shaped_like(arrays, 1.0), 1, pid)
        reply.content["metrics"]["drift"], reply.content["metrics"]["own"] = drift, 5.0
        if pid == 0:
            reply.content["metrics"]["rare"] = 7.0
        replies.append(reply)
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["drift"] == pytest.approx(3.0) and metrics["own"] == -1.0 and metrics["rare"] == 7.0
    replies[0].content["metrics"]["undeclared"] = 1.0
    _, metrics = strategy.aggregate_train(2, replies)
    assert metrics["replies"] == 2 and metrics["drift"] == pytest.approx(4.0)
    assert ["undeclared" in f["reason"] for f in strategy.failures] == [True]


def test_bad_replies_are_dropped_and_logged(setup) -> None:
    strategy, arrays, msgs = setup
    good = make_reply(msgs[0], shaped_like(arrays, 1.0), 5, 0)
    nan = shaped_like(arrays, 1.0)
    nan[next(iter(nan))][...] = np.nan
    bad_nan = make_reply(msgs[1], nan, 5, 1)
    wrong = shaped_like(arrays, 1.0)
    key = next(iter(wrong))
    wrong[key] = np.zeros((3, 3), dtype=np.float32)
    bad_shape = make_reply(msgs[2], wrong, 5, 2)
    new, metrics = strategy.aggregate_train(1, [bad_nan, good, bad_shape])
    assert metrics["replies"] == 1 and metrics["failures"] == 2
    assert all(np.allclose(v.numpy(), 1.0) for v in new.values())
    reasons = " ".join(f["reason"] for f in strategy.failures)
    assert "NaN" in reasons and "expected" in reasons
    error = Message(Error(code=0, reason="ValueError: boom"), reply_to=msgs[0])
    new, metrics = strategy.aggregate_train(1, [error])  # the other two sampled nodes sent nothing
    assert new is None and metrics["failures"] == 3
    reasons = sorted(f["reason"] for f in strategy.failures)
    assert reasons[0] == "ValueError: boom" and all("no reply within round-timeout" in r for r in reasons[1:])


def test_sampling_is_seeded_by_partition_not_node_id(task_identity) -> None:
    cfg = validate({"fraction-train": 0.4, "seed": 7})
    picks = []
    for ids in ({1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, {50: 3, 10: 0, 40: 4, 20: 1, 30: 2}):
        strategy = FedAvgStrategy(cfg)
        grid = FakeGrid(ids)
        chosen = [strategy.sample(r, grid) for r in range(1, 6)]
        picks.append([sorted(ids[n] for n in c) for c in chosen])
        assert all(len(c) == 2 for c in chosen)
    assert picks[0] == picks[1]
    assert len({tuple(p) for p in picks[0]}) > 1  # rounds differ


def test_weighted_average_properties() -> None:
    rng = np.random.default_rng(0)
    models = [{"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.array(4, dtype=np.int64)} for _ in range(4)]
    same = weighted_average(models, [1, 1, 1, 1])
    mean = np.mean([m["w"] for m in models], axis=0, dtype=np.float64)  # float64, as weighted_average sums
    assert np.allclose(same["w"], mean, rtol=2.0**-23, atol=1e-12)  # then rounds once to float32
    assert same["w"].dtype == np.float32 and same["n"].dtype == np.int64 and same["n"] == 4
    assert same["n"].shape == () and same["w"].shape == (3, 2)  # BN's 0-d counters stay 0-d
    one = weighted_average(models, [0, 0, 3, 0])
    assert np.array_equal(one["w"], models[2]["w"])
    scaled = weighted_average(models, [2, 4, 6, 8])
    assert np.allclose(scaled["w"], weighted_average(models, [1, 2, 3, 4])["w"])
    with pytest.raises(ValueError):
        weighted_average(models, [0, 0, 0, 0])
    assert summarize_clients([0.5, 1.0]) == (0.75, 0.25)


def test_pooled_accuracy_is_the_clients_correct_answers_over_their_test_samples() -> None:
    """A client with 30 of 40 right and one with 1 of 10: pooled 31 / 50, where the mean over clients
    is (0.75 + 0.1) / 2; equal splits give the mean; a client without test samples weighs nothing;
    none at all: NaN."""
    assert pooled_accuracy([(30 / 40, 40), (1 / 10, 10)]) == pytest.approx(31 / 50, abs=1e-15)
    assert pooled_accuracy([(0.5, 20), (1.0, 20)]) == pytest.approx(0.75, abs=1e-15)
    assert pooled_accuracy([(0.5, 20), (1.0, 0)]) == 0.5
    assert np.isnan(pooled_accuracy([])) and np.isnan(pooled_accuracy([(1.0, 0)]))


def test_a_clientapp_exception_is_recorded_by_its_type_and_message(setup) -> None:
    """Ray's traceback of a failed simulated ClientApp: failures.jsonl keeps the exception that says
    what went wrong (it lies past the first 500 characters), in one bounded line."""
    from tests.test_reasons import REAL

    strategy, _arrays, msgs = setup
    strategy.aggregate_train(1, [Message(Error(code=0, reason=REAL["ray-direct-cause"]), reply_to=msgs[0])])
    reason = next(f["reason"] for f in strategy.failures if f["node"] == msgs[0].metadata.dst_node_id)
    assert reason.startswith("zipfile.BadZipFile: File is not a zip file: /data/.fedskew-cache/") and len(reason) < 200
