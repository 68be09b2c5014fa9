"""FedPHP: the HPM schedule against the authors' `generate_mu`, the HPM's moving average over
rounds, its first teacher, the transfer acting on the uploaded model, one local step against the
authors' code, the server's participation counts in the checkpoint, and the real apps in process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedphp import FedPHPTrainer
from fedskew.client_app.hpm import HPM_TENSORS
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.losses import hpm_momentum, mmd_multi_gaussian
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.strategies.fedphp import FedPHPStrategy
from tests.harness import FLOAT64, IN_FLOAT64, WIRE_ROUNDING, cut_and_resume, labelled_images, trainer_context


def generate_mu(cnt: int, c_ratio: float, max_round: int) -> float:
    """lxcnju/FedRepo @ 617ee01, algorithms/fedphp.py `generate_mu`, re-derived."""
    mean_sam = max(int(c_ratio * max_round), 1)
    return min(max(0.9 * cnt / mean_sam, 0.0), 0.9)


def _data(n: int = 60, seed: int = 0) -> ClientData:
    return labelled_images((1, 4, 7), n, 12, seed=seed)


def _cfg(**over) -> dict:
    raw = {"method": "fedphp", "model": "lenet", "num-server-rounds": 25, "fraction-train": 0.3, "batch-size": 16}
    return validate({**raw, **over})


def _trainer(cls, cfg: dict, state: RecordDict, server_round: int, data: ClientData | None = None):
    return cls(trainer_context(cfg, data or _data(), state, 2, server_round))


def _content(server_round: int, arrays: dict) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord({"server-round": server_round})})


def _initial() -> dict:
    return FedAvgStrategy(validate({"model": "lenet"})).initial_arrays().to_torch_state_dict()


def _global(seed: int) -> dict:
    """A global model other than the initial one."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in _initial().items()}


# ---------------------------------------------------------------------- the schedule
@pytest.mark.parametrize(("q", "rounds"), [(0.3, 25), (0.2, 150), (1.0, 3), (0.01, 50)])
def test_hpm_schedule_is_the_authors_generate_mu(q: float, rounds: int) -> None:
    """mu of the n-th participation = generate_mu(n - 1): int(Q T) (0.3 x 25 = 7.5 -> 7, where MAP's
    schedule divides by 7.5), clipped at 0.9, 0 at a first participation."""
    trainer = _trainer(FedPHPTrainer, _cfg(**{"fraction-train": q, "num-server-rounds": rounds}), RecordDict(), 1)
    qt = trainer.expected_participations()
    mus = [hpm_momentum(n, qt, 0.9, 0.9) for n in range(1, 40)]
    assert mus == pytest.approx([generate_mu(n - 1, q, rounds) for n in range(1, 40)], abs=1e-12)
    assert mus[0] == 0.0 and max(mus) == 0.9


def test_client_rounds_follow_the_schedule_and_average_into_the_hpm() -> None:
    cfg, state = _cfg(), RecordDict()  # int(Q T) = 7
    uploads, hpms, mus = [], [], []
    for r in (1, 2, 3):
        reply = _trainer(FedPHPTrainer, cfg, state, r).fit(_content(r, _global(r)))
        uploads.append(reply["arrays"].to_torch_state_dict())
        hpms.append(state[f"tensors.{HPM_TENSORS}"].to_torch_state_dict())
        mus.append(reply["metrics"]["hpm-mu"])
        assert reply["metrics"]["hpm-participations"] == r
    assert mus == pytest.approx([0.0, 0.9 / 7, 1.8 / 7])
    # first participation, mu = 0: the HPM is the trained (uploaded) model
    assert all(torch.equal(hpms[0][k], uploads[0][k]) for k in uploads[0])
    for r in (1, 2):  # psi <- mu psi + (1 - mu) theta
        for k, theta in uploads[r].items():
            torch.testing.assert_close(hpms[r][k], mus[r] * hpms[r - 1][k] + (1 - mus[r]) * theta)


def test_the_first_teacher_is_the_initial_network_and_the_personal_model_the_hpm(monkeypatch) -> None:
    seen = []
    transfer = FedPHPTrainer.transfer_loss

    def spy(self, fwd, weight, extras):
        seen.append({k: v.clone() for k, v in self.teacher.state_dict().items()})
        return transfer(self, fwd, weight, extras)

    monkeypatch.setattr(FedPHPTrainer, "transfer_loss", spy)
    state = RecordDict()
    trainer = _trainer(FedPHPTrainer, _cfg(), state, 4)
    trainer.fit(_content(4, _global(4)))  # a client first seen in round 4
    initial = _initial()
    assert seen and all(torch.equal(seen[0][k], v) for k, v in initial.items())
    hpm = state[f"tensors.{HPM_TENSORS}"].to_torch_state_dict()
    assert trainer.personalized_model(None) is trainer.hpm
    assert all(torch.equal(trainer.hpm.state_dict()[k], v) for k, v in hpm.items())


def test_the_transfer_acts_on_the_uploaded_model() -> None:
    """lambda = 0 uploads exactly FedAvg's locally trained model; lambda > 0 another one (FedPHP trains
    the downloaded model with the transfer term and uploads it, unlike MAP's separate stage 2)."""
    g = _global(2)

    def upload(cls, **over) -> dict:
        state = RecordDict()
        _trainer(FedPHPTrainer, _cfg(), state, 1).fit(_content(1, g))  # an HPM unlike the global model
        return _trainer(cls, _cfg(**over), state, 2).fit(_content(2, g))["arrays"].to_torch_state_dict()

    plain = upload(FedAvgTrainer)
    assert all(torch.equal(v, plain[k]) for k, v in upload(FedPHPTrainer, **{"fedphp-transfer-weight": 0.0}).items())
    for over in ({}, {"fedphp-transfer": "mmd"}):
        moved = upload(FedPHPTrainer, **over)
        assert not torch.equal(moved["classifier.weight"], plain["classifier.weight"])


# ---------------------------------------------------------------------- the authors' code
def test_mmd_is_the_authors_mmd_rbf_noaccelerate() -> None:
    """lxcnju/FedRepo @ 617ee01, tools.py guassian_kernel + mmd_rbf_noaccelerate, re-derived; in
    float64 (a difference of kernel sums: in float32 its rounding depends on the CPU), the same formula
    to 1e-12, and the authors' 1e-8 added to the bandwidth moves it by less than 1e-6."""
    torch.manual_seed(0)
    h, hp = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64) + 0.3
    total = torch.cat([h, hp])
    d2 = ((total.unsqueeze(1) - total.unsqueeze(0)) ** 2).sum(2)
    n = 16

    def authors(eps: float) -> torch.Tensor:
        bandwidth = (d2.sum() / (n**2 - n) + eps) / 2.0 ** (5 // 2)
        k = sum(torch.exp(-d2 / (bandwidth * 2.0**i)) for i in range(5))
        return (k[:8, :8] + k[8:, 8:] - k[:8, 8:] - k[8:, :8]).mean()

    ours = mmd_multi_gaussian(h, hp)
    torch.testing.assert_close(ours, authors(0.0), rtol=1e-12, atol=0)
    assert abs(float(ours - authors(1e-8))) < 1e-6


def test_one_local_step_against_the_authors_code() -> None:
    """lxcnju/FedRepo @ 617ee01, algorithms/fedphp.py update_local with reg_way "KD": ce = CE(logits),
    reg = -(softmax(plogits / 4) * log_softmax(logits)).sum(1).mean(), loss = (1 - c) ce + c reg,
    one SGD step; then update_hpm with generate_mu(cnt = 1)."""
    data = _data(30)
    data = ClientData(data.x_train[:16], data.y_train[:16], data.x_test, data.y_test, 10)  # one batch
    cfg = _cfg(**{"lr": 0.1, "momentum": 0.0, "weight-decay": 0.0, "fedphp-transfer-weight": 0.3}, **IN_FLOAT64)
    hpm = {k: v.double() if v.is_floating_point() else v for k, v in _global(7).items()}  # float64: a shuffled batch
    state = RecordDict()
    ClientState(state, cfg["state-max-mb"], 2).save_tensors(HPM_TENSORS, hpm)
    ClientState(state, cfg["state-max-mb"], 2).save_values("fedphp", {"participations": 1})
    g = _global(8)
    reply = _trainer(FedPHPTrainer, cfg, state, 5, data).fit(_content(5, g))

    student, teacher = (_trainer(FedAvgTrainer, cfg, RecordDict(), 5).build_model() for _ in range(2))
    student.load_state_dict(g)
    teacher.load_state_dict(hpm)
    x = data.x_train.double()
    logits, plogits = student(x), teacher(x).detach()
    ce = F.cross_entropy(logits, data.y_train)
    reg = (-1.0 * (plogits / 4.0).softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1).mean()
    ((1 - 0.3) * ce + 0.3 * reg).backward()
    with torch.no_grad():
        for p in student.parameters():
            p -= 0.1 * p.grad
    got = reply["arrays"].to_torch_state_dict()
    for k, v in student.state_dict().items():  # rounded to float32 on the wire
        torch.testing.assert_close(got[k].to(v.dtype), v, **WIRE_ROUNDING)
    mu = generate_mu(1, 0.3, 25)
    new_hpm = state[f"tensors.{HPM_TENSORS}"].to_torch_state_dict()
    for k, v in student.state_dict().items():
        torch.testing.assert_close(new_hpm[k], mu * hpm[k] + (1 - mu) * v, **FLOAT64)


# ---------------------------------------------------------------------- the server
def test_the_server_counts_participations_across_a_checkpoint(task_identity) -> None:
    cfg = _cfg()

    def reply(z: int) -> Message:
        content = RecordDict(
            {
                "arrays": ArrayRecord(),
                "metrics": MetricRecord(
                    {"num-examples": 10, "partition-id": 4, "hpm-participations": z, "hpm-mu": 0.1}
                ),
            }
        )
        return Message(content, dst_node_id=1, message_type="train")

    strategy = FedPHPStrategy(cfg)
    assert strategy.aggregate_extras(1, [reply(1)])["hpm-first"] == 1
    resumed = FedPHPStrategy(cfg)
    resumed.load_state_dict(strategy.state_dict())
    out = resumed.aggregate_extras(2, [reply(2)])
    assert out["hpm-state-lost"] == 0 and out["hpm-first"] == 0
    assert FedPHPStrategy(cfg).aggregate_extras(2, [reply(2)])["hpm-state-lost"] == 0
    assert resumed.aggregate_extras(3, [reply(1)])["hpm-state-lost"] == 1  # the client lost its HPM


# ---------------------------------------------------------------------- the real apps, in process
def test_in_process_run_and_resume_with_the_clients_hpms(tmp_path, task_identity) -> None:
    """4 nodes of 40 partitions, 3 rounds; then the same run cut before round 3 and resumed on the same
    nodes (their HPMs in their contexts): the same metrics and model (`cut_and_resume`)."""
    job = {
        "method": "fedphp",
        "model": "lenet",
        "fraction-train": 0.5,
        "partition": "iid",
        "local-epochs": 1,
        "lr": 0.05,
    }
    full, _, _ = cut_and_resume(tmp_path, job, num_nodes=4, num_partitions=40, rounds=3)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["replies"] for r in rows] == [2, 2, 2] and all(r["hpm-state-lost"] == 0 for r in rows)
    assert rows[0]["hpm-first"] == 2 and rows[0]["hpm-mu-mean"] == 0.0
    assert rows[2]["global-accuracy"] > 0.3
