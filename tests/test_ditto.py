"""Ditto (Li, Hu, Beirami & Smith, ICML'21): the personal model's objective, its state, and runs of
the real ServerApp and ClientApp in process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from fedskew.client_app.base import BaseTrainer
from fedskew.client_app.ditto import PERSONAL, DittoTrainer, parameter_distance
from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.models import build_model
from fedskew.registry import get_method
from tests.conftest import read_metrics
from tests.harness import FLOAT64, IN_FLOAT64, cut_and_resume, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer

PLAIN_SGD = {"momentum": 0.0, "weight-decay": 0.0}


def received_params(content: RecordDict) -> list[torch.Tensor]:
    model = build_model("mlp", "fashion-mnist")
    model.load_state_dict(content["arrays"].to_torch_state_dict())
    return [p.detach() for p in model.parameters()]


def trained_ditto(content: RecordDict, **overrides) -> BaseTrainer:
    trainer = make_trainer(DittoTrainer, make_data(), **overrides)
    trainer.fit(content)
    return trainer


def test_the_personal_model_tends_to_the_global_model_as_lambda_grows() -> None:
    """v_k starts at w^0 (seed 0) and trains against w^t (seed 5, far from w^0) with plain SGD (lr
    0.01, 10 steps: lr * lambda < 1 keeps every pull a contraction): the larger lambda, the closer v_k
    ends to w^t; at lambda = 0 it is a purely local model that stays near w^0."""
    content = global_content(5)
    w = received_params(content)
    start = parameter_distance(build_model_at(0).parameters(), w)
    gaps = []
    for lam in (0.0, 0.3, 3.0, 30.0):
        trainer = trained_ditto(content, **{"ditto-lambda": lam}, **PLAIN_SGD)
        gaps.append(parameter_distance(trainer.personal.parameters(), w))
    assert all(a > b for a, b in itertools.pairwise(gaps)), gaps
    assert gaps[0] == pytest.approx(start, rel=0.05)  # lambda = 0: no pull
    assert gaps[-1] < 0.1 * gaps[0]


def build_model_at(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", "fashion-mnist")


def test_lambda_is_the_only_tie_between_the_personal_and_the_global_model() -> None:
    """At lambda = 0 the personal model is the same whatever global model arrives; at lambda > 0 it is not."""
    a, b = global_content(5), global_content(6)

    def personal(content: RecordDict, lam: float) -> dict[str, torch.Tensor]:
        return trained_ditto(content, **{"ditto-lambda": lam}).personal.state_dict()

    free_a, free_b = personal(a, 0.0), personal(b, 0.0)
    assert all(torch.equal(free_a[k], free_b[k]) for k in free_a)
    tied_a, tied_b = personal(a, 1.0), personal(b, 1.0)
    assert not all(torch.equal(tied_a[k], tied_b[k]) for k in tied_a)


def test_the_upload_is_fedavgs_local_update() -> None:
    """Ditto's global model is FedAvg's: the uploaded w_k^t is FedAvg's, bit for bit."""
    content = global_content(5)
    ditto = make_trainer(DittoTrainer, make_data()).fit(content)["arrays"].to_torch_state_dict()
    fedavg = make_trainer(FedAvgTrainer, make_data()).fit(content)["arrays"].to_torch_state_dict()
    assert ditto.keys() == fedavg.keys() and all(torch.equal(ditto[k], fedavg[k]) for k in ditto)


def test_one_personal_step_equals_the_authors_update() -> None:
    """One full-batch personal step from a stored v against the received w, compared with the update
    of the authors' code (litian96/ditto at 26d9b29a62f3872dcdf071be08e897607c283bb4,
    flearn/trainers_MTL/ditto.py: eff_grad = grad + lam * (v - w_global); v <- v - lr * eff_grad),
    with the gradient of the batch-mean cross-entropy taken here by autograd."""
    data, content = make_data(), global_content(5)
    lam, lr = 0.7, 0.05
    record = RecordDict()
    state = ClientState(record, 64, 0)
    v0 = build_model_at(7).double()  # float64 on both sides: the trainer shuffles its batch
    state.save_round_tensors(PERSONAL, v0.state_dict(), 1)  # kept in round 1
    cfg = {**PLAIN_SGD, "augment": "none", "batch-size": 80, "local-epochs": 1, "ditto-personal-epochs": 1}
    cfg.update({"ditto-lambda": lam, **IN_FLOAT64})
    trainer = make_trainer(DittoTrainer, data, state=record, server_round=2, lr=lr, **cfg)
    reply = trainer.fit(content)

    loss = F.cross_entropy(v0(data.x_train.double()), data.y_train)
    grads = torch.autograd.grad(loss, list(v0.parameters()))
    w = [p.double() for p in received_params(content)]
    expected = [v - lr * (g + lam * (v - wk)) for v, g, wk in zip(v0.parameters(), grads, w, strict=True)]
    for got, want in zip(trainer.personal.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), **FLOAT64)
    assert reply["metrics"]["ditto-distance"] == pytest.approx(parameter_distance(expected, w), rel=1e-9)
    saved = state.load_tensors(PERSONAL)
    assert all(torch.equal(saved[k], v) for k, v in trainer.personal.state_dict().items())


def test_a_first_personal_model_is_the_initial_global_model_and_persists() -> None:
    """A client seen for the first time starts v_k at w^0, the server's initial model (the authors'
    code); the v_k it trains is the one it starts from next round."""
    cfg = validate({"method": "ditto", "model": "mlp"})
    w0 = get_method("ditto").strategy_class()(cfg).initial_arrays().to_torch_state_dict()
    state = RecordDict()
    untrained = make_trainer(DittoTrainer, make_data(), **{"ditto-personal-epochs": 0})
    untrained.fit(global_content(5))
    assert all(torch.equal(untrained.personal.state_dict()[k], w0[k]) for k in w0)

    first = trained_ditto_with(state, 1)
    again = make_trainer(DittoTrainer, make_data(), state=state, server_round=2, **{"ditto-personal-epochs": 0})
    again.fit(global_content(6))
    kept = first.personal.state_dict()
    assert all(torch.equal(again.personal.state_dict()[k], kept[k]) for k in kept)
    assert not all(torch.equal(kept[k], w0[k]) for k in w0)


def trained_ditto_with(state: RecordDict, server_round: int) -> BaseTrainer:
    trainer = make_trainer(DittoTrainer, make_data(), state=state, server_round=server_round)
    trainer.fit(global_content(5))
    return trainer


IN_PROCESS = {"model": "mlp", "partition": "dirichlet", "fraction-train": 1.0, "local-test-fraction": 0.2}


def test_in_process_ditto_keeps_fedavgs_global_model_and_resumes(tmp_path, task_identity) -> None:
    """The real ServerApp and ClientApp (4 nodes of 50 partitions, 3 rounds): a run cut before its
    last round and resumed beside nodes that kept their v_k ends as the uninterrupted one
    (`cut_and_resume`); Ditto's global model is FedAvg's, and its personal models report their distance."""
    full, _, _ = cut_and_resume(tmp_path / "ditto", {**IN_PROCESS, "method": "ditto"}, rounds=3)
    fedavg = tmp_path / "fedavg"
    run_in_process(
        {**IN_PROCESS, "method": "fedavg", "num-server-rounds": 3, "out-dir": str(fedavg), "run-name": "r"}, 4, None, 50
    )
    rows, reference = read_metrics(full), read_metrics(fedavg / "r")
    assert [r["global-accuracy"] for r in rows] == [r["global-accuracy"] for r in reference]
    assert all(r["ditto-distance"] > 0 and r["failures"] == 0 for r in rows)
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(fedavg / "r" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
