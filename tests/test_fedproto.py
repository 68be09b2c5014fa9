"""FedProto: prototype aggregation and the distance loss against hand computations, one local step
against the authors' code, the prototype term acting, only prototypes travelling, the server's
screening, and the real ServerApp/ClientApp in process (with --resume keeping the client models)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.fedproto import MODEL_TENSORS, FedProtoTrainer, PrototypeClassifier
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.losses.fedproto import global_prototypes, prototype_distance_loss, prototype_logits
from fedskew.methods.fedproto import FEDPROTO_PROTOTYPES as PROTOS
from fedskew.records import Rejected, check_content
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.strategies.fedproto import FedProtoStrategy
from tests.harness import FLOAT64, IN_FLOAT64, cut_and_resume, labelled_images, trainer_context


# ---------------------------------------------------------------------- maths
def test_global_prototypes_against_hand_computation() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    b = np.array([[3.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    ca, cb = np.array([3, 1, 0, 0]), np.array([1, 0, 2, 0])
    protos, valid = global_prototypes([a, b], [ca, cb], "counts")
    # class 0: (3 [1, 0] + 1 [3, 0]) / 4; classes 1, 2: their only holder's; class 3: nobody's
    np.testing.assert_allclose(protos, [[1.5, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, 0.0]])
    assert valid.tolist() == [True, True, True, False] and protos.dtype == np.float32
    protos, valid = global_prototypes([a, b], [ca, cb], "clients")  # the code: plain mean over holders
    np.testing.assert_allclose(protos, [[2.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError):
        global_prototypes([a], [ca], "median")


def test_prototype_distance_loss_against_hand_computation_and_the_authors_mse() -> None:
    z = torch.tensor([[1.0, 2.0], [0.0, -1.0], [5.0, 5.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], requires_grad=True)
    valid = torch.tensor([True, True, False])  # class 2 has no global prototype yet
    loss = prototype_distance_loss(z, y, protos, valid)
    assert loss.item() == pytest.approx(((1 + 4) + (1 + 4)) / (3 * 2))  # the third sample adds 0
    # yuetan031/FedProto @ 97e42e2, lib/update.py update_weights_het: proto_new = protos.data with the
    # rows of labels that have a global prototype replaced, then nn.MSELoss()(proto_new, protos)
    proto_new = z.detach().clone()
    proto_new[:2] = protos.detach()[y[:2]]
    assert loss.item() == pytest.approx(F.mse_loss(proto_new, z).item())
    loss.backward()
    expected = torch.zeros(3, 2)
    expected[:2] = 2 * (z.detach()[:2] - protos.detach()[y[:2]]) / 6
    torch.testing.assert_close(z.grad, expected)
    assert protos.grad is None  # the global prototypes are fixed
    nothing = prototype_distance_loss(z, y, protos, torch.zeros(3, dtype=torch.bool))
    assert nothing.item() == 0.0 and nothing.requires_grad  # round 1: CE alone


def test_prototype_inference_picks_the_nearest_valid_prototype() -> None:
    z = torch.tensor([[0.1, 0.0], [2.9, 3.0], [10.0, 10.0]])
    protos = torch.tensor([[0.0, 0.0], [3.0, 3.0], [10.0, 10.0]])
    logits = prototype_logits(z, protos, torch.tensor([True, True, False]))
    assert logits.argmax(1).tolist() == [0, 1, 1]  # class 2 is nearest to the third but has no prototype
    torch.testing.assert_close(logits[0, :2], -torch.tensor([0.1, (2.9**2 + 3.0**2) ** 0.5]))
    assert torch.isfinite(logits).all() and (logits[:, 2] < logits[:, :2].min(1).values).all()
    with pytest.raises(ValueError):
        prototype_logits(z, protos, torch.zeros(3, dtype=torch.bool))


# ---------------------------------------------------------------------- the client
def _data(n: int = 48, seed: int = 0) -> ClientData:
    return labelled_images((0, 3, 5), n, 12, seed=seed)


def _cfg(**over) -> dict:
    return validate({"method": "fedproto", "model": "lenet", "batch-size": 12, **over})


def _content(server_round: int, protos: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> RecordDict:
    protos = torch.zeros(10, 84) if protos is None else protos
    valid = torch.zeros(10, dtype=torch.bool) if valid is None else valid
    return RecordDict(
        {
            "arrays": ArrayRecord(),
            "config": ConfigRecord({"server-round": server_round}),
            PROTOS: ArrayRecord({"prototypes": protos, "valid": valid}),
        }
    )


def _trainer(cfg: dict, state: RecordDict, server_round: int = 1, data: ClientData | None = None) -> FedProtoTrainer:
    return FedProtoTrainer(trainer_context(cfg, data or _data(), state, 3, server_round))


def test_only_prototypes_travel_and_the_model_stays_on_the_client() -> None:
    cfg, state = _cfg(), RecordDict()
    reply = _trainer(cfg, state).fit(_content(1))
    assert len(reply["arrays"]) == 0  # no model array leaves the client
    rec = reply[PROTOS]
    counts = rec["counts"].numpy()
    assert counts.tolist() == _data().train_counts.tolist() and rec["counts"].dtype == "int64"
    assert np.abs(rec["prototypes"].numpy()[counts == 0]).max() == 0.0  # zero rows for absent classes
    m = reply["metrics"]
    assert m["proto-loss"] == 0.0 and m["prototype-inference"] == 0  # round 1: no global prototype
    assert "client-global-accuracy" not in m and "personal-accuracy" in m  # no global model arrives
    saved = state[f"tensors.{MODEL_TENSORS}"].to_torch_state_dict()
    # round 2 starts from the saved model, not from a fresh network
    trainer = _trainer(cfg, state, 2)
    trainer.received = trainer.receive(_content(2))
    model = trainer.build_model()
    trainer.load_global(model, _content(2))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    # a server message that carries model arrays is refused before anything is trained
    bad = _content(2)
    bad["arrays"] = ArrayRecord({"classifier.weight": torch.zeros(10, 84)})
    with pytest.raises(Rejected):
        _trainer(cfg, state, 2).fit(bad)


def test_a_first_participation_starts_from_the_run_initial_network() -> None:
    cfg = _cfg()
    trainer = _trainer(cfg, RecordDict())
    trainer.received = trainer.receive(_content(1))
    model = trainer.build_model()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    trainer.load_global(model, _content(1))
    assert torch.equal(torch.rand(1), before)  # the client's random stream is not disturbed
    initial = FedAvgStrategy(validate({"model": "lenet"})).initial_arrays().to_torch_state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())


def test_one_local_step_against_the_authors_code() -> None:
    """yuetan031/FedProto @ 97e42e2 (lib/update.py update_weights_het): loss1 = NLLLoss(log_softmax),
    loss2 = MSELoss(proto_new, protos), loss = loss1 + ld * loss2, one SGD step (fresh optimiser:
    momentum has no effect on the first step)."""
    data = _data(24)
    cfg = _cfg(
        **{"batch-size": 12, "lr": 0.05, "momentum": 0.0, "weight-decay": 0.0, "fedproto-lambda": 0.7}, **IN_FLOAT64
    )
    data = ClientData(data.x_train[:12], data.y_train[:12], data.x_test, data.y_test, 10)  # one batch
    g = torch.Generator().manual_seed(5)
    protos, valid = torch.randn(10, 84, generator=g), torch.tensor([True, False] * 5)
    trainer = _trainer(cfg, RecordDict(), 2, data)
    trainer.fit(_content(2, protos, valid))
    got = trainer.ctx.state.load_tensors(MODEL_TENSORS)

    ref = FedProtoTrainer.build_model(trainer)
    ref.load_state_dict(FedAvgStrategy(validate({"model": "lenet"})).initial_arrays().to_torch_state_dict())
    ref.train()
    x, y = data.x_train.double(), data.y_train  # float64 on both sides: the trainer shuffles its batch
    feats = ref.features(x)
    loss1 = F.nll_loss(F.log_softmax(ref.classifier(feats), dim=1), y)
    proto_new = feats.detach().clone()
    for i, label in enumerate(y.tolist()):
        if valid[label]:
            proto_new[i] = protos[label]
    loss = loss1 + 0.7 * F.mse_loss(proto_new, feats)
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.05 * p.grad
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, **FLOAT64)


def test_the_prototype_term_pulls_the_embeddings_onto_the_global_prototypes() -> None:
    """Removing the term (lambda = 0) leaves the local prototypes far from the global ones; with it
    they move onto them."""
    data = _data(96)
    targets = torch.zeros(10, 84)
    targets[[0, 3, 5]] = torch.tensor([1.0, 0.5, 0.25])[:, None] * torch.ones(3, 84)
    valid = torch.zeros(10, dtype=torch.bool)
    valid[[0, 3, 5]] = True
    distance, term = {}, {}
    for lam in (0.0, 10.0):
        cfg = _cfg(**{"fedproto-lambda": lam, "local-epochs": 5, "lr": 0.05})
        reply = _trainer(cfg, RecordDict(), 2, data).fit(_content(2, targets, valid))
        local = reply[PROTOS]["prototypes"].numpy()[[0, 3, 5]]
        distance[lam] = float(np.linalg.norm(local - targets[[0, 3, 5]].numpy(), axis=1).mean())
        term[lam] = reply["metrics"]["proto-loss"]
    assert distance[10.0] < distance[0.0] / 4  # measured: 2.3 against 13.3
    assert term[10.0] < term[0.0] / 5  # the mean distance term over the steps: 0.17 against 1.50


def test_the_personal_model_predicts_by_prototype_or_by_its_head() -> None:
    protos, valid = torch.randn(10, 84), torch.ones(10, dtype=torch.bool)
    by_proto = _trainer(_cfg(), RecordDict(), 2)
    reply = by_proto.fit(_content(2, protos, valid))
    assert reply["metrics"]["prototype-inference"] == 1
    model = by_proto.build_model()
    assert isinstance(by_proto.personalized_model(model), PrototypeClassifier)
    head = _trainer(_cfg(**{"fedproto-inference": "classifier"}), RecordDict(), 2)
    assert head.fit(_content(2, protos, valid))["metrics"]["prototype-inference"] == 0
    valid[5] = False  # one of the client's classes (0, 3, 5) has no global prototype yet: the head
    assert _trainer(_cfg(), RecordDict(), 2).fit(_content(2, protos, valid))["metrics"]["prototype-inference"] == 0


# ---------------------------------------------------------------------- the server
def _reply(strategy: FedProtoStrategy, pid: int, protos: np.ndarray, counts: np.ndarray, arrays=None) -> Message:
    content = RecordDict(
        {
            "arrays": arrays or ArrayRecord(),
            "metrics": MetricRecord({"num-examples": int(counts.sum()), "partition-id": pid, "proto-loss": 0.5}),
            PROTOS: ArrayRecord({"prototypes": torch.from_numpy(protos), "counts": torch.from_numpy(counts)}),
        }
    )
    return Message(content, dst_node_id=pid + 1, message_type="train")


def test_the_server_aggregates_each_rounds_uploads_and_keeps_unheld_classes(task_identity) -> None:
    strategy = FedProtoStrategy(_cfg())
    assert len(strategy.initial_arrays()) == 0 and strategy.global_model(ArrayRecord()) is None
    sent = strategy.broadcast(1)[PROTOS]
    assert not sent["valid"].numpy().any()  # round 1: no prototype yet
    p = np.ones((10, 84), np.float32)
    one = [_reply(strategy, 0, p, np.array([5, 1] + [0] * 8)), _reply(strategy, 1, 3 * p, np.array([0, 3] + [0] * 8))]
    out = strategy.aggregate_extras(1, one)
    assert strategy.valid.tolist() == [True, True] + [False] * 8 and out["prototype-classes-updated"] == 2
    np.testing.assert_allclose(strategy.prototypes[1], (1 * 1 + 3 * 3) / 4 * p[1])  # count-weighted
    strategy.aggregate_extras(2, [_reply(strategy, 0, 2 * p, np.array([0, 4] + [0] * 8))])
    np.testing.assert_array_equal(strategy.prototypes[1], 2 * p[1])  # this round's holders only
    np.testing.assert_array_equal(strategy.prototypes[0], p[0])  # nobody held class 0: kept
    assert strategy.valid.tolist() == [True, True] + [False] * 8
    assert strategy.broadcast(3)[PROTOS]["valid"].numpy().tolist() == strategy.valid.tolist()
    state = strategy.state_dict()
    other = FedProtoStrategy(_cfg())
    other.load_state_dict(state)
    assert np.array_equal(other.prototypes, strategy.prototypes) and np.array_equal(other.valid, strategy.valid)


def test_the_server_screens_uploads(task_identity) -> None:
    strategy = FedProtoStrategy(_cfg(**{"partition": "iid"}))
    strategy.num_partitions, strategy.node_partitions = 20, {1: 0}
    schema = strategy.reply_schema()
    counts = strategy.partition_class_counts(0).astype(np.int64)
    p = np.zeros((10, 84), np.float32)
    check_content(_reply(strategy, 0, p, counts).content, schema)
    strategy.check_reply(_reply(strategy, 0, p, counts).content, 0)
    with pytest.raises(Rejected, match="unexpected"):  # a model array in the upload
        check_content(_reply(strategy, 0, p, counts, ArrayRecord({"w": torch.zeros(2)})).content, schema)
    moved = counts.copy()
    moved[0], moved[1] = moved[0] - 1, moved[1] + 1  # same total, not the partition's counts
    with pytest.raises(Rejected, match="partition 0's"):  # exceeds one class, differs from the partition
        strategy.check_reply(_reply(strategy, 0, p, moved).content, 0)


# ---------------------------------------------------------------------- the real apps, in process
JOB = {
    "method": "fedproto",
    "model": "lenet",
    "num-server-rounds": 2,
    "fraction-train": 1.0,
    "partition": "iid",
    "local-epochs": 1,
    "checkpoint-every": 1,
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_in_process_run_and_resume_with_the_clients_models(tmp_path, task_identity) -> None:
    """4 nodes of 40 partitions, 2 rounds; then the same run cut before round 2 and resumed on the same
    nodes (their models in their contexts): the same metrics (`cut_and_resume`); no global model."""
    run_dir, _, _ = cut_and_resume(tmp_path, JOB, num_nodes=4, num_partitions=40, rounds=2)
    rows = _rows(run_dir)
    assert [r["replies"] for r in rows] == [4, 4] and rows[1]["prototype-classes"] == 10
    assert all(r["global-accuracy"] is None and r["client-global-accuracy"] is None for r in rows)
    assert rows[1]["personalized-accuracy"] > max(0.4, rows[0]["personalized-accuracy"])  # the models stay
    assert rows[1]["proto-loss"] > 0 and not (run_dir / "model.pt").exists()
