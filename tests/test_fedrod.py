"""FedRoD (Chen & Chao, ICLR'22): the balanced softmax against a hand computation, the personalized
head's risk, one local step, the personalized head in the client state, and runs of the real
ServerApp and ClientApp in process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from fedskew.client_app.fedrod import PERSONAL_HEAD, FedRoDTrainer
from fedskew.client_app.state import ClientState
from fedskew.losses.fedrod import balanced_softmax_loss, class_log_prior, personalized_risk
from fedskew.models import build_model
from tests.conftest import read_metrics
from tests.harness import FLOAT64, IN_FLOAT64, WIRE_ROUNDING, cut_and_resume
from tests.test_trainers import OBSERVED, global_content, make_data, make_trainer

LOGITS = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
TARGETS = [0, 1]
COUNTS = [4, 1, 0]


def test_balanced_softmax_against_a_hand_computation() -> None:
    """-log(N_y^gamma e^{z_y} / sum_c N_c^gamma e^{z_c}) by hand; the absent class 2 leaves the sum."""
    e = math.exp

    def by_hand(gamma: float) -> float:
        w = [n**gamma if n else 0.0 for n in COUNTS]
        rows = [
            -math.log(w[y] * e(z[y]) / sum(wc * e(zc) for wc, zc in zip(w, z, strict=True)))
            for z, y in zip(LOGITS, TARGETS, strict=True)
        ]
        return sum(rows) / len(rows)

    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    for gamma in (1.0, 0.5):
        loss = balanced_softmax_loss(logits, torch.tensor(TARGETS), class_log_prior(COUNTS, gamma))
        # float64 but the float32 prior: gamma log 4 within an ulp (2^-23), which moves the loss no more
        assert float(loss.detach()) == pytest.approx(by_hand(gamma), abs=2**-22)
    assert by_hand(1.0) == pytest.approx((-math.log(4 * e(1) / (4 * e(1) + e(2))) - math.log(e(-1) / (4 + e(-1)))) / 2)
    loss.backward()
    assert torch.all(logits.grad[:, 2] == 0) and torch.isfinite(logits.grad).all()  # no push on an absent class
    plain = balanced_softmax_loss(logits, torch.tensor(TARGETS), class_log_prior(COUNTS, 0.0))
    assert float(plain.detach()) == pytest.approx(float(F.cross_entropy(logits.detach(), torch.tensor(TARGETS))))


def test_class_log_prior() -> None:
    prior = class_log_prior([4, 1, 0], 2.0)
    assert prior.tolist()[:2] == pytest.approx([2 * math.log(4), 0.0]) and prior[2] == -math.inf
    assert class_log_prior([4, 1, 0], 0.0).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        class_log_prior([1, -1], 1.0)
    with pytest.raises(ValueError):
        class_log_prior([1, 1], -0.5)


def test_the_personalized_risk_trains_the_personal_head_only() -> None:
    g = torch.tensor(LOGITS, requires_grad=True)
    p = torch.zeros(2, 3, requires_grad=True)
    loss = personalized_risk(g, p, torch.tensor(TARGETS))
    loss.backward()
    assert g.grad is None
    expected = (F.softmax(torch.tensor(LOGITS), 1) - F.one_hot(torch.tensor(TARGETS), 3)) / 2
    torch.testing.assert_close(p.grad, expected)


def test_one_local_step_equals_pfllibs_and_the_personal_head_persists() -> None:
    """One full-batch step compared with PFLlib's FedRoD client (TsingZ0/PFLlib at
    04240b9708b520f21882387945aefd34f740b975, system/flcore/clients/clientrod.py: body and generic head
    step on the balanced softmax of out_g; the personal head steps on CE(out_g.detach() + p(rep.detach()))),
    from the w^0 personal head of a first participation, gradients taken here by autograd."""
    data, lr = make_data(), 0.05
    state = RecordDict()
    overrides = {"momentum": 0.0, "weight-decay": 0.0, "augment": "none", "batch-size": 80, "local-epochs": 1}
    trainer = make_trainer(FedRoDTrainer, data, state=state, lr=lr, **overrides, **IN_FLOAT64)  # a shuffled batch
    content = global_content(5)
    reply = trainer.fit(content)

    model = build_model("mlp", "fashion-mnist").double()
    model.load_state_dict(content["arrays"].to_torch_state_dict())
    torch.manual_seed(0)
    personal = build_model("mlp", "fashion-mnist").classifier.double()  # w^0's head (seed 0)
    x, y = data.x_train.double(), data.y_train
    rep = model.features(x)
    out_g = model.classifier(rep)
    prior = class_log_prior(data.train_counts).double()  # log N_c, as the trainer holds it (float32)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(out_g + prior, y), params)
    (g_p,) = torch.autograd.grad(F.cross_entropy(out_g.detach() + personal(rep.detach()), y), [personal.weight])

    uploaded = reply["arrays"].to_torch_state_dict()
    for (k, p), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(uploaded[k].double(), (p - lr * g).detach(), **WIRE_ROUNDING)
    kept = ClientState(state, 64, 0).load_tensors(PERSONAL_HEAD)["weight"]
    torch.testing.assert_close(kept, (personal.weight - lr * g_p).detach(), **FLOAT64)

    again = make_trainer(FedRoDTrainer, data, state=state, server_round=2, lr=lr, **overrides, **IN_FLOAT64)
    again.fit(content)
    assert not torch.equal(again.personal.weight.detach(), kept)  # it trained on, from the kept head


def test_balanced_softmax_spares_the_generic_head_of_absent_classes() -> None:
    """Plain SGD: under the balanced softmax the generic head's rows of the classes the client lacks
    get no gradient; with gamma = 0 (plain cross-entropy) they are pushed down."""
    content = global_content(5)
    sent = content["arrays"].to_torch_state_dict()["classifier.weight"]
    absent = [c for c in range(10) if c not in OBSERVED]
    for gamma, untouched in ((1.0, True), (0.0, False)):
        overrides = {"momentum": 0.0, "weight-decay": 0.0, "fedrod-gamma": gamma}
        head = make_trainer(FedRoDTrainer, make_data(), **overrides).fit(content)["arrays"]["classifier.weight"]
        assert torch.equal(torch.from_numpy(head.numpy())[absent], sent[absent]) is untouched


def test_the_personalized_model_adds_the_two_heads() -> None:
    trainer = make_trainer(FedRoDTrainer, make_data())
    content = global_content(5)
    model = trainer.build_model()
    trainer.received = trainer.receive(content)
    trainer.load_global(model, content)
    trainer.local_train(model, content)
    x = make_data().x_test
    with torch.no_grad():
        h = model.features(x)
        torch.testing.assert_close(trainer.personalized_model(model)(x), model.classifier(h) + trainer.personal(h))


IN_PROCESS = {"model": "mlp", "partition": "dirichlet", "fraction-train": 1.0, "local-test-fraction": 0.2}


def test_in_process_fedrod_runs_and_resumes(tmp_path, task_identity) -> None:
    """The real ServerApp and ClientApp (4 nodes of 50 partitions, 3 rounds): the generic model is
    evaluated centrally, and a run cut before its last round and resumed beside nodes that kept their
    personal heads ends as the uninterrupted one (`cut_and_resume`)."""
    full, _, _ = cut_and_resume(tmp_path, {**IN_PROCESS, "method": "fedrod"}, rounds=3)
    rows = read_metrics(full)
    assert all(r["failures"] == 0 and r["global-accuracy"] > 0.2 and r["fedrod-personal-loss"] > 0 for r in rows)
