"""FedProc: the prototypical contrastive loss against a hand computation, its schedule, the trainer
(round 1 is FedAvg, then the prototypes act), the server's prototypes, and a resumed run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, RecordDict

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedproc import FedProcTrainer
from fedskew.config import validate
from fedskew.losses.fedproc import prototype_weight, prototypical_contrastive_loss
from fedskew.strategies.fedproc import FedProcStrategy
from fedskew.training import seed_everything
from tests.harness import cut_and_resume, trainer_context
from tests.test_fedmr import reply
from tests.test_trainers import global_content, make_data

PROTOS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
VALID = torch.tensor([True, True, False])


def test_prototypical_loss_matches_a_hand_computation() -> None:
    z = torch.tensor([[1.0, 1.0], [0.0, -1.0], [3.0, 1.0]], dtype=torch.float64)  # float64: to 1e-12 on any CPU
    y = torch.tensor([0, 1, 2])  # class 2 has no prototype: left out
    # cosines: sample 0 -> (1/sqrt2, 1/sqrt2), sample 1 -> (0, -1); class 2 is no negative either
    for t in (1.0, 0.5):
        want = (math.log(2.0) + (1.0 / t + math.log(1.0 + math.exp(-1.0 / t)))) / 2
        got = prototypical_contrastive_loss(z, y, PROTOS.double(), VALID, temperature=t).item()
        assert got == pytest.approx(want, rel=1e-12), t
    assert prototypical_contrastive_loss(z[2:], y[2:], PROTOS, VALID).item() == 0.0


def test_prototypical_loss_pulls_features_to_their_class_prototype() -> None:
    g = torch.Generator().manual_seed(0)
    protos = F.normalize(torch.randn(5, 8, generator=g), dim=1)
    y = torch.arange(5).repeat(4)
    z = torch.randn(20, 8, generator=g).requires_grad_(True)
    valid = torch.ones(5, dtype=torch.bool)
    opt = torch.optim.SGD([z], lr=2.0)
    first = prototypical_contrastive_loss(z, y, protos, valid, 0.1).item()
    for _ in range(100):
        opt.zero_grad()
        prototypical_contrastive_loss(z, y, protos, valid, 0.1).backward()
        opt.step()
    assert prototypical_contrastive_loss(z, y, protos, valid, 0.1).item() < first / 20
    assert (F.normalize(z, dim=1) @ protos.T).argmax(1).tolist() == y.tolist()


def test_the_prototype_weight_anneals_from_one_to_zero() -> None:
    assert [prototype_weight(t, 5) for t in range(1, 6)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert prototype_weight(1, 1) == 1.0
    with pytest.raises(ValueError):
        prototype_weight(6, 5)


# ---------------------------------------------------------------------------------------------- trainer
def fedproc_trainer(server_round: int, method: str = "fedproc", **overrides):
    cfg = validate({"method": method, "model": "mlp", "batch-size": 16, "num-server-rounds": 3, **overrides})
    ctx = trainer_context(cfg, make_data(), None, 0, server_round, seed_everything(cfg["seed"], 0, server_round))
    return (FedProcTrainer if method == "fedproc" else FedAvgTrainer)(ctx), cfg


def with_round(content: RecordDict, server_round: int, extra: dict | None = None) -> RecordDict:
    out = RecordDict({**dict(content.items()), **(extra or {})})
    out["config"] = ConfigRecord({"server-round": server_round})
    return out


def test_round_one_is_fedavg_and_uploads_prototypes_then_the_prototypes_act() -> None:
    trainer, cfg = fedproc_trainer(1)
    strategy = FedProcStrategy(cfg)
    r1 = trainer.fit(with_round(global_content(), 1, strategy.broadcast(1)))
    avg = fedproc_trainer(1, method="fedavg")[0].fit(with_round(global_content(), 1))
    a, b = r1["arrays"].to_torch_state_dict(), avg["arrays"].to_torch_state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.items())  # no prototype yet: plain CE
    assert r1["metrics"]["proto-active"] == 0 and r1["metrics"]["proto-alpha"] == 1.0
    counts = r1["fedproc-prototypes"]["counts"].numpy()
    assert counts.sum() == 80 and set(np.flatnonzero(counts)) == {1, 4, 7}

    strategy.prototypes = np.random.default_rng(0).normal(size=(10, 200)).astype(np.float32)
    strategy.valid[:] = True
    r2 = fedproc_trainer(2)[0].fit(with_round(global_content(), 2, strategy.broadcast(2)))
    avg2 = fedproc_trainer(2, method="fedavg")[0].fit(with_round(global_content(), 2))
    assert r2["metrics"]["proto-active"] == 1 and r2["metrics"]["proto-alpha"] == 0.5
    assert r2["metrics"]["proto-loss"] > 0
    w2, w_avg = r2["arrays"].to_torch_state_dict(), avg2["arrays"].to_torch_state_dict()
    assert max((w2[k] - v).abs().max().item() for k, v in w_avg.items()) > 1e-4
    # the constant schedule holds fedproc-alpha
    r3 = fedproc_trainer(2, **{"fedproc-schedule": "constant", "fedproc-alpha": 0.2})[0]
    m3 = r3.fit(with_round(global_content(), 2, strategy.broadcast(2)))["metrics"]
    assert m3["proto-alpha"] == 0.2


def test_the_server_weights_prototypes_by_counts_keeps_stale_ones_and_refuses_inflated_counts(task_identity) -> None:
    s = FedProcStrategy(validate({"method": "fedproc", "model": "mlp"}))
    s.sent_arrays = s.initial_arrays()
    s.num_partitions = 5
    s.node_partitions = {10 + p: p for p in range(5)}
    s.class_counts = np.full((5, 10), 50)  # partitions of 50 examples a class: the counts below stay within
    c, d = 10, s.feature_dim
    ones, cls = np.ones((c, d), np.float32), np.arange(c)
    replies = [
        reply(s, 0, ones, np.where(cls < 2, 30, 0), record="fedproc-prototypes"),
        reply(s, 1, 4 * ones, np.where(cls == 1, 10, 0), record="fedproc-prototypes"),
        reply(s, 2, ones, np.full(c, 50), num=100, record="fedproc-prototypes"),  # counts > num-examples
    ]
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["replies"] == 2 and "> num-examples" in s.failures[0]["reason"]
    np.testing.assert_allclose(s.prototypes[1], (30 + 40) / 40)
    assert s.valid.tolist() == [True, True] + [False] * 8
    s.aggregate_train(2, [reply(s, 0, 7 * ones, np.where(cls == 0, 5, 0), record="fedproc-prototypes")])
    np.testing.assert_allclose(s.prototypes[0], 7.0)
    np.testing.assert_allclose(s.prototypes[1], 70 / 40)  # stale: nobody held class 1 in round 2
    assert s.broadcast(3)["fedproc-prototypes"]["valid"].numpy().tolist() == s.valid.tolist()


def test_fedproc_runs_in_process_and_resumes_with_its_prototypes(tmp_path, task_identity) -> None:
    full, _, _ = cut_and_resume(tmp_path, {"method": "fedproc"}, rounds=3)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["prototype-classes"] for r in rows] == [10, 10, 10]
    assert [r["proto-alpha"] for r in rows] == [1.0, 0.5, 0.0] and rows[1]["proto-loss"] > 0
