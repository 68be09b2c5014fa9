"""MAP (restricted softmax + inherited private model): maths, the two-stage client, the server
bookkeeping, and real `flwr run` jobs (state round-trip over three rounds, end to end)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.base import TrainerContext
from fedskew.client_app.map import MAPTrainer
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.losses import distillation_loss, hpm_momentum, hpm_update, mmd_multi_gaussian, personalization_loss
from fedskew.models import build_model
from fedskew.strategies.map import MAPStrategy
from tests.conftest import read_metrics


# ---------------------------------------------------------------------- HPM moving average (Eq. 10)
def _sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "n": torch.tensor(seed, dtype=torch.long)}


def test_hpm_update_limits_and_interpolation() -> None:
    old, new = _sd(1), _sd(2)
    keep_new = hpm_update(old, new, 0.0)  # mu = 0: the HPM only keeps the current personalized model
    assert torch.equal(keep_new["w"], new["w"])
    keep_old = hpm_update(old, new, 1.0)  # mu = 1: an independent private model
    assert torch.equal(keep_old["w"], old["w"])
    mid = hpm_update(old, new, 0.3)
    torch.testing.assert_close(mid["w"], 0.3 * old["w"] + 0.7 * new["w"])
    assert mid["n"].dtype == torch.long and int(mid["n"]) == 2  # integer buffers copied, not averaged
    first = hpm_update(None, new, 0.7)  # no HPM yet: it becomes the personalized model
    assert torch.equal(first["w"], new["w"]) and first["w"].data_ptr() != new["w"].data_ptr()
    with pytest.raises(ValueError):
        hpm_update(old, new, 1.5)


def test_hpm_momentum_schedule() -> None:
    qt = 0.5 * 30  # Q T: expected participations
    assert hpm_momentum(1, qt) == 0.0  # first participation
    assert hpm_momentum(2, qt) == pytest.approx(0.9 / 15)
    assert hpm_momentum(6, qt, mu_bar=0.9) == pytest.approx(0.9 * 5 / 15)
    mus = [hpm_momentum(n, qt) for n in range(1, 40)]
    assert all(a <= b for a, b in itertools.pairwise(mus))  # never decreases
    assert max(mus) == 1.0 and hpm_momentum(39, qt, mu_max=0.9) == 0.9  # clipped (paper 1, code 0.9)
    assert hpm_momentum(3, 0.2) == 1.0  # Q T floored at 1: 0.9 * 2 / 1, clipped
    assert hpm_momentum(2, 0.2, mu_bar=0.5) == 0.5
    with pytest.raises(ValueError):
        hpm_momentum(0, qt)


# ---------------------------------------------------------------------- transfer terms (Eqs. 11-13)
def test_distillation_gradient_points_to_teacher_and_spares_teacher() -> None:
    torch.manual_seed(0)
    student = torch.randn(8, 10, requires_grad=True)
    teacher_param = torch.randn(8, 10, requires_grad=True)
    tau = 4.0
    loss = distillation_loss(student, teacher_param * 1.0, tau)
    assert loss.item() > 0
    loss.backward()
    assert teacher_param.grad is None  # no gradient reaches the HPM
    expected = (F.softmax(student / tau, 1) - F.softmax(teacher_param / tau, 1)) / (tau * 8)
    torch.testing.assert_close(student.grad, expected.detach())
    # a small step against the gradient moves the student's distribution toward the teacher's
    with torch.no_grad():
        stepped = student - 5.0 * student.grad
        assert distillation_loss(stepped, teacher_param, tau) < loss
    same = torch.randn(4, 10)
    assert distillation_loss(same, same, tau).abs().item() < 1e-6
    # the code's variant (teacher-only softening) is a different loss at equal logits
    assert distillation_loss(same * 3, same * 3, tau, soften_student=False).item() > 1e-3


def test_mmd_properties() -> None:
    torch.manual_seed(0)
    h, g = torch.randn(16, 84), torch.randn(16, 84)
    assert mmd_multi_gaussian(h, h.clone()).abs().item() < 1e-6  # identical feature sets
    d = mmd_multi_gaussian(h, g)
    assert d.item() >= -1e-6
    torch.testing.assert_close(d, mmd_multi_gaussian(g, h))  # symmetric
    small, large = mmd_multi_gaussian(h, g + 0.5), mmd_multi_gaussian(h, g + 3.0)
    assert d < small < large  # grows with a constant shift of one batch
    x = h.clone().requires_grad_(True)
    mmd_multi_gaussian(x, g + 1.0).backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_personalization_loss_without_hpm_is_ce() -> None:
    ce, tr = torch.tensor(2.0), torch.tensor(0.5)
    assert personalization_loss(ce, None, 0.3) is ce
    assert personalization_loss(ce, tr, 0.0) == ce
    assert personalization_loss(ce, tr, 0.25).item() == pytest.approx(0.75 * 2.0 + 0.25 * 0.5)


# ---------------------------------------------------------------------- the two-stage client
def _data(seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([0, 3] * 40)
    x = torch.randn(80, 1, 28, 28, generator=g) + y.view(-1, 1, 1, 1).float()
    return ClientData(x[:64], y[:64], x[64:], y[64:], 10)


def _cfg(**over) -> dict:
    raw = {"method": "map", "num-server-rounds": 10, "fraction-train": 0.5, "batch-size": 16, **over}
    return validate(raw)


def _fit(cfg: dict, state: RecordDict, server_round: int, global_sd: dict) -> tuple[MAPTrainer, RecordDict]:
    ctx = TrainerContext(
        cfg=cfg,
        data=_data(),
        device=torch.device("cpu"),
        state=ClientState(state, cfg["state-max-mb"], 7),
        partition_id=7,
        server_round=server_round,
        generator=torch.Generator().manual_seed(server_round),
    )
    trainer = MAPTrainer(ctx)
    content = RecordDict({"arrays": ArrayRecord(global_sd), "config": ConfigRecord({"server-round": server_round})})
    return trainer, trainer.fit(content)


def _global() -> dict:
    torch.manual_seed(0)
    return build_model("lenet", "fashion-mnist").state_dict()


def test_client_state_round_trip_and_first_participation(monkeypatch) -> None:
    cfg, state, g = _cfg(), RecordDict(), _global()
    calls = []
    monkeypatch.setattr(MAPTrainer, "transfer_loss", lambda self, *a: calls.append(1) or torch.zeros(()))
    trainer, reply = _fit(cfg, state, 1, g)
    m = reply["metrics"]
    assert m["hpm-participations"] == 1 and m["hpm-transfer"] == 0 and m["hpm-mu"] == 0.0
    assert not calls  # the first participation never uses the (absent) HPM
    # mu = 0: the HPM is exactly the stage-2 model, and it is what personal accuracy measures
    hpm1 = state["tensors.hpm"].to_torch_state_dict()
    assert all(torch.equal(hpm1[k], v) for k, v in trainer.stage2_model.state_dict().items())
    assert m["personal-accuracy"] == m["stage2-accuracy"]
    for r in (2, 3):
        trainer, reply = _fit(cfg, state, r, g)
        assert reply["metrics"]["hpm-participations"] == r and reply["metrics"]["hpm-transfer"] == 1
    assert calls  # later participations use it
    assert reply["metrics"]["hpm-mu"] == pytest.approx(0.9 * 2 / 5)
    assert not torch.equal(state["tensors.hpm"].to_torch_state_dict()["classifier.weight"], hpm1["classifier.weight"])
    # the upload is the stage-1 model: global keys/shapes, no HPM tensors
    assert list(reply["arrays"].keys()) == list(g) and not any("hpm" in k for k in reply["arrays"].keys())


def test_upload_does_not_depend_on_stage_two() -> None:
    g = _global()
    state = RecordDict()
    _fit(_cfg(), state, 1, g)
    uploads = []
    for over in ({}, {"map-transfer-weight": 0.9, "map-personal-epochs": 2}, {"map-transfer": "mmd"}):
        st = RecordDict({k: v for k, v in state.items()})
        uploads.append(_fit(_cfg(**over), st, 2, g)[1]["arrays"].to_torch_state_dict())
    for other in uploads[1:]:
        assert all(torch.equal(uploads[0][k], other[k]) for k in other)


def test_mu_bar_zero_keeps_current_personalized_model() -> None:
    cfg, state, g = _cfg(**{"map-mu-bar": 0.0}), RecordDict(), _global()
    _fit(cfg, state, 1, g)
    trainer, _ = _fit(cfg, state, 2, g)
    hpm = state["tensors.hpm"].to_torch_state_dict()
    assert all(torch.equal(hpm[k], v) for k, v in trainer.stage2_model.state_dict().items())


def test_lost_state_restarts_and_server_flags_it(task_identity) -> None:
    cfg, g = _cfg(), _global()
    strategy = MAPStrategy(cfg)

    def reply(state: RecordDict, r: int) -> Message:
        content = _fit(cfg, state, r, g)[1]
        return Message(content, dst_node_id=1, message_type="train")

    state = RecordDict()
    assert strategy.aggregate_extras(1, [reply(state, 1)])["hpm-state-lost"] == 0
    out = strategy.aggregate_extras(2, [reply(state, 2)])
    assert out["hpm-state-lost"] == 0 and out["hpm-participations-max"] == 2 and out["hpm-first"] == 0
    out = strategy.aggregate_extras(3, [reply(RecordDict(), 3)])  # SuperNode restarted: empty context
    assert out["hpm-state-lost"] == 1 and out["hpm-participations-max"] == 1 and out["hpm-first"] == 1


def test_uniform_aggregation_by_default(task_identity) -> None:
    def msg(value: float, n: int) -> Message:
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": torch.full((2,), value)}),
                "metrics": MetricRecord({"num-examples": n, "partition-id": 0}),
            }
        )
        return Message(content, dst_node_id=1, message_type="train")

    replies = [msg(0.0, 1), msg(4.0, 3)]
    uniform = MAPStrategy(_cfg()).aggregate_arrays(1, replies)
    weighted = MAPStrategy(_cfg(**{"map-uniform-aggregation": False})).aggregate_arrays(1, replies)
    assert math.isclose(float(uniform["w"].numpy()[0]), 2.0)  # Alg. 1: 1/|S_t|
    assert math.isclose(float(weighted["w"].numpy()[0]), 3.0)  # num-examples weights


# ---------------------------------------------------------------------- real flwr runs
@pytest.mark.slow
def test_flwr_state_round_trip_three_rounds(flwr_job) -> None:
    _, run_dir = flwr_job({"method": "map", "num-server-rounds": 3, "fraction-train": 1.0}, 5, "map-state")
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:  # every client's counter survives the rounds in context.state
        assert r["hpm-participations-min"] == r["hpm-participations-max"] == r["round"]
        assert r["hpm-state-lost"] == 0
    assert [r["hpm-first"] for r in rows] == [5, 0, 0]
    assert rows[0]["hpm-mu-mean"] == 0.0 < rows[2]["hpm-mu-mean"]


@pytest.mark.slow
def test_flwr_map_mmd_end_to_end(flwr_job) -> None:
    job = {"method": "map", "num-server-rounds": 3, "fraction-train": 0.6, "map-transfer": "mmd"}
    summary, run_dir = flwr_job(job, 5, "map-mmd")
    assert summary["method"] == "map" and summary["rounds"] == 3
    assert summary["final_personalized_accuracy"] > 0.8  # 2 classes per client
    assert summary["best_global_accuracy"] > 0.2  # 3 of 5 clients a round see ~6 classes; chance is 0.1
    rows = read_metrics(run_dir)
    assert all(1 <= r["hpm-participations-min"] <= r["hpm-participations-max"] <= r["round"] for r in rows)
    assert all(r["hpm-state-lost"] == 0 for r in rows)
