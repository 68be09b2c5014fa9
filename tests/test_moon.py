"""MOON: the model-contrastive loss against a hand computation, one local step against the authors'
code, the previous local model as client state (first participation, retries), and a resumed run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.moon import SLOTS, MOONTrainer
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.losses.moon import model_contrastive_loss
from fedskew.models import build_model
from fedskew.records import Number
from fedskew.training import seed_everything
from tests.harness import IN_FLOAT64, WIRE_ROUNDING, cut_and_resume, trainer_context
from tests.test_trainers import make_data


def test_contrastive_loss_matches_a_hand_computation() -> None:
    f64 = torch.float64  # the hand computation's arithmetic
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=f64)
    z_glob = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=f64)  # cosines 1 and 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 1.0], [-1.0, -1.0]], dtype=f64)  # cosines 0 and -1
    # -log(e^{p/t} / (e^{p/t} + e^{n/t})) = log(1 + e^{(n - p)/t}), t = 0.5
    want = (math.log(1 + math.exp(-2.0)) + math.log(1 + math.exp(-2.0 - math.sqrt(2.0)))) / 2
    assert model_contrastive_loss(z, z_glob, z_prev, 0.5).item() == pytest.approx(want, rel=1e-12)
    assert model_contrastive_loss(z, z_glob, None, 0.5).item() == 0.0  # no negative: the code's one logit


def test_contrastive_loss_pulls_to_the_global_and_pushes_from_the_previous_representation() -> None:
    g = torch.Generator().manual_seed(0)
    z_glob, z_prev = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    z = (z_prev + 0.1 * torch.randn(16, 8, generator=g)).requires_grad_(True)  # starts at the negative
    opt = torch.optim.SGD([z], lr=1.0)
    first = model_contrastive_loss(z, z_glob, z_prev, 0.5).item()
    for _ in range(200):
        opt.zero_grad()
        model_contrastive_loss(z, z_glob, z_prev, 0.5).backward()
        opt.step()
    last = model_contrastive_loss(z, z_glob, z_prev, 0.5).item()
    at_glob = model_contrastive_loss(z_glob, z_glob, z_prev, 0.5).item()  # z = z_glob: cos 1 to the positive
    assert last < first / 10 and last <= at_glob + 0.02
    assert F.cosine_similarity(z, z_glob).mean() > 0.9 and F.cosine_similarity(z, z_prev).mean() < 0.5


# ---------------------------------------------------------------------------------------------- the trainer
def moon_trainer(state: RecordDict, server_round: int, method: str = "moon", **overrides) -> MOONTrainer:
    cfg = validate({"method": method, "model": "mlp", "batch-size": 16, **overrides})
    ctx = trainer_context(cfg, make_data(), state, 0, server_round, seed_everything(cfg["seed"], 0, server_round))
    return (MOONTrainer if method == "moon" else FedAvgTrainer)(ctx)


def content(server_round: int, seed: int = 0) -> RecordDict:
    torch.manual_seed(seed)
    arrays = ArrayRecord(build_model("mlp", "fashion-mnist").state_dict())
    return RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})})


def arrays(reply: RecordDict) -> dict[str, torch.Tensor]:
    return reply["arrays"].to_torch_state_dict()


def test_first_participation_is_fedavg_then_the_previous_model_is_the_negative() -> None:
    state = RecordDict()
    r1 = moon_trainer(state, 1).fit(content(1))
    avg = moon_trainer(RecordDict(), 1, method="fedavg").fit(content(1))
    assert r1["metrics"]["moon-negative"] == 0 and r1["metrics"]["moon-loss"] == 0.0
    assert all(torch.equal(v, arrays(avg)[k]) for k, v in arrays(r1).items())  # no negative: plain CE
    saved = state["tensors.moon-previous"].to_torch_state_dict()
    assert all(torch.equal(v, arrays(r1)[k]) for k, v in saved.items())  # the uploaded local model is kept

    r2 = moon_trainer(state, 2).fit(content(2, seed=1))
    avg2 = moon_trainer(RecordDict(), 2, method="fedavg").fit(content(2, seed=1))
    assert r2["metrics"]["moon-negative"] == 1 and r2["metrics"]["moon-loss"] > 0
    diff = max((v - arrays(avg2)[k]).abs().max().item() for k, v in arrays(r2).items())
    assert diff > 1e-4  # the contrastive term moved the model


def test_a_retried_round_keeps_the_earlier_model_as_its_negative() -> None:
    """Round 2 sent twice (a retry, or a resumed run repeating it) gives the same reply: its negative is
    round 1's model both times, never the first attempt's own round-2 model."""
    state = RecordDict()
    moon_trainer(state, 1).fit(content(1))
    first = moon_trainer(state, 2).fit(content(2, seed=1))
    again = moon_trainer(state, 2).fit(content(2, seed=1))
    assert all(torch.equal(v, arrays(again)[k]) for k, v in arrays(first).items())
    assert first["metrics"]["moon-loss"] == again["metrics"]["moon-loss"]
    moon_trainer(state, 3).fit(content(3, seed=2))  # round 3 keeps round 2's model as "before"
    rounds = ClientState(state, 64, 0).load_values("moon", dict.fromkeys(SLOTS, Number(int, 1, 3)))
    assert rounds == {"moon-previous": 3, "moon-before": 2}


def test_one_local_step_matches_the_authors_code() -> None:
    """One SGD step derived from QinbinLi/MOON at 8fcba3c4 (`main.py` `train_net_fedcon`): logits
    [cos(z, z_glob), cos(z, z_prev)] / temperature, `mu * CrossEntropy(logits, 0)` added to the
    cross-entropy of the output, SGD with momentum 0.9 and weight decay, z the representation the
    contrast is taken on (here `features(x)`, the code's `use_project_head=0`)."""
    mu, temperature, lr, wd = 5.0, 0.5, 0.05, 1e-5
    torch.manual_seed(3)
    prev_sd = build_model("mlp", "fashion-mnist").double().state_dict()  # float64: the trainer shuffles its batch
    state = RecordDict()
    saved = ClientState(state, 64, 0)
    saved.save_tensors("moon-previous", prev_sd)
    saved.save_values("moon", {"moon-previous": 1})
    over = {"moon-mu": mu, "moon-temperature": temperature, "lr": lr, "weight-decay": wd, "batch-size": 256}
    got = arrays(moon_trainer(state, 2, **over, **IN_FLOAT64).fit(content(2)))

    # the reference, written from the code's operations
    net, global_net, previous_net = (build_model("mlp", "fashion-mnist").double() for _ in range(3))
    glob_sd = content(2)["arrays"].to_torch_state_dict()
    net.load_state_dict(glob_sd)
    global_net.load_state_dict(glob_sd)
    previous_net.load_state_dict(prev_sd)
    global_net.eval()
    previous_net.eval()
    data = make_data()
    x, target = data.x_train.double(), data.y_train
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    cos = torch.nn.CosineSimilarity(dim=-1)
    criterion = torch.nn.CrossEntropyLoss()
    pro1 = net.features(x)
    out = net.classifier(pro1)
    with torch.no_grad():
        pro2, pro3 = global_net.features(x), previous_net.features(x)
    logits = torch.cat((cos(pro1, pro2).reshape(-1, 1), cos(pro1, pro3).reshape(-1, 1)), dim=1) / temperature
    loss = criterion(out, target) + mu * criterion(logits, torch.zeros(len(x), dtype=torch.long))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    want = net.state_dict()

    plain = arrays(moon_trainer(RecordDict(), 2, method="fedavg", **over).fit(content(2)))
    for k, v in want.items():
        assert torch.allclose(got[k].double(), v, **WIRE_ROUNDING), k
    assert max((plain[k] - v).abs().max().item() for k, v in want.items()) > 1e-4  # the term mattered


def test_moon_runs_in_process_and_resumes_with_its_client_state(tmp_path, task_identity) -> None:
    """The nodes keep the previous local models (as SuperNodes do), so a resumed run contrasts against
    the same models as the uninterrupted one and ends with the same metrics and model."""
    full, _, _ = cut_and_resume(tmp_path, {"method": "moon"}, rounds=3)
    rows = [line for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert '"moon-negative": 0.0' in rows[0] and '"moon-negative": 1.0' in rows[1]
