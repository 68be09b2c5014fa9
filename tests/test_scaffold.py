"""SCAFFOLD and SCAFFOLD + restricted softmax: the corrected step, option II's control variates on
hand examples, the server's c, the client state, one round against NIID-Bench's procedure, and
in-process runs (the invariant c = (1/N) sum_i c_i, and resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedrs import FedRSTrainer
from fedskew.client_app.scaffold import CLIENT_CONTROL, ScaffoldTrainer
from fedskew.client_app.scaffold_rs import ScaffoldRSTrainer
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import client_indices
from fedskew.losses import fedrs_scale
from fedskew.losses.scaffold import correct_after_step, scaffold_control_deltas
from fedskew.models import build_model
from fedskew.registry import get_method
from fedskew.strategies.aggregate import scaffold_control_update, server_step
from fedskew.strategies.scaffold import ScaffoldStrategy
from tests.harness import FLOAT64, IN_FLOAT64, WIRE_ROUNDING, cut_and_resume, mean_node_state
from tests.test_trainers import global_content, make_data, make_trainer

NAMES = [k for k, _ in build_model("mlp", "fashion-mnist").named_parameters()]


def controls(seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = build_model("mlp", "fashion-mnist")
    return {k: scale * torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}


def with_client_control(c_i: dict[str, torch.Tensor], written: int) -> RecordDict:
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(CLIENT_CONTROL, c_i, written)
    return state


def client_control(state: RecordDict, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    return ClientState(state, 64, 0).load_round_tensors(CLIENT_CONTROL, like or controls(0), 10**6)


def equal(a: ArrayRecord, b: ArrayRecord) -> bool:
    sa, sb = a.to_torch_state_dict(), b.to_torch_state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------- the step
def test_correction_after_each_step_on_a_hand_example() -> None:
    """y <- y - lr (g - c_i + c) at momentum 0; the correction stays outside the momentum buffer."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    c, c_i = torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.25])
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    correct_after_step(opt, [c - c_i])
    for _ in range(2):
        opt.zero_grad()
        p.sum().backward()  # g = [1, 1]
        opt.step()
    # step 1: buffer = g -> [1, 2] - 0.1 [1, 1] - 0.1 [0.5, -0.25] = [0.85, 1.925]
    # step 2: buffer = 0.9 g + g = 1.9 g -> [0.85 - 0.19 - 0.05, 1.925 - 0.19 + 0.025]
    assert torch.allclose(p.detach(), torch.tensor([0.61, 1.76]), atol=1e-6)


def test_corrected_step_is_plain_sgd_when_the_controls_agree() -> None:
    """c = c_i: SCAFFOLD's local training is FedAvg's, bit for bit (momentum and weight decay on);
    c != c_i: the correction moves the result."""
    c = controls(1)
    content = global_content(server_round=2, control=ArrayRecord(c))
    scaffold = make_trainer(ScaffoldTrainer, make_data(), state=with_client_control(c, 1), server_round=2)
    plain = make_trainer(FedAvgTrainer, make_data(), server_round=2)
    got = scaffold.fit(content)
    assert equal(got["arrays"], plain.fit(global_content(server_round=2))["arrays"])
    assert got["metrics"]["correction-norm"] == 0.0
    other = make_trainer(ScaffoldTrainer, make_data(), state=with_client_control(controls(2), 1), server_round=2)
    assert not equal(other.fit(content)["arrays"], got["arrays"])


def test_option_ii_control_update_and_server_update_on_a_hand_example() -> None:
    """Delta c_i = (x - y_i) / (K eta_l) - c (Alg. 1 line 12, option II); c + (1/N) sum_i Delta c_i (line 17)."""
    x, c = {"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([0.2, -0.4], np.float32)}
    y1, y2 = {"w": np.array([0.5, 1.0], np.float32)}, {"w": np.array([1.0, 2.5], np.float32)}
    d1, d2 = scaffold_control_deltas(c, x, [y1, y2], [5, 2], 0.1)
    np.testing.assert_allclose(d1["w"], [1.0 - 0.2, 2.0 + 0.4], rtol=1e-6)  # (x - y1) / 0.5 = [1, 2]
    np.testing.assert_allclose(d2["w"], [0.0 - 0.2, -2.5 + 0.4], rtol=1e-6)  # (x - y2) / 0.2 = [0, -2.5]
    new = scaffold_control_update(c, [d1, d2], num_clients=4)
    np.testing.assert_allclose(new["w"], [0.2 + (0.8 - 0.2) / 4, -0.4 + (2.4 - 2.1) / 4], rtol=1e-6)
    assert new["w"].dtype == np.float32
    avg = {"w": np.array([3.0, 0.0], np.float32), "n": np.array(7)}
    np.testing.assert_allclose(server_step(x, avg, 0.5)["w"], [2.0, 1.0])  # x + 0.5 (avg - x)
    assert server_step(x, avg, 0.5)["n"] == 7 and server_step(x, avg, 1.0) == avg


def test_client_control_moves_as_option_ii_says() -> None:
    """After a round the client's c_i is c_i - c + (x - y) / (K eta_l), y its trained model."""
    c, c_i = controls(1), controls(2)
    state = with_client_control(c_i, 1)
    content = global_content(server_round=2, control=ArrayRecord(c))
    trainer = make_trainer(ScaffoldTrainer, make_data(), state=state, server_round=2, **{"lr": 0.05})
    reply = trainer.fit(content)
    x, y = content["arrays"].to_torch_state_dict(), reply["arrays"].to_torch_state_dict()
    k = int(reply["metrics"]["train-steps"])
    assert k == 2 * 5  # 2 epochs of ceil(80 / 16) batches
    new = client_control(state)
    for name in NAMES:
        want = c_i[name] - c[name] + (x[name] - y[name]) / (k * 0.05)
        assert torch.allclose(new[name], want, atol=1e-5), name


def test_one_round_equals_niid_benchs_procedure() -> None:
    """Two full-batch steps against the procedure of NIID-Bench (Xtra-Computing/NIID-Bench at 61b901ab,
    experiments.py `train_net_scaffold`), written out here: torch SGD(momentum, weight decay) step,
    then every parameter minus lr (c_global - c_local); c_new = c_local - c_global + (x - y) / (cnt lr)."""
    c, c_i, lr = controls(1), controls(2), 0.05
    c_i = {k: v.double() for k, v in c_i.items()}  # both sides in float64: the trainer shuffles its batch
    data = make_data()
    cfg = {"lr": lr, "momentum": 0.9, "weight-decay": 1e-5, "batch-size": 80, "local-epochs": 2}
    content = global_content(server_round=2, control=ArrayRecord(c))
    state = with_client_control(c_i, 1)
    reply = make_trainer(ScaffoldTrainer, data, state=state, server_round=2, **cfg, **IN_FLOAT64).fit(content)

    net = build_model("mlp", "fashion-mnist").double()
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    x = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(net(data.x_train.double()), data.y_train).backward()
        opt.step()
        with torch.no_grad():
            for k, p in net.named_parameters():
                p -= lr * (c[k] - c_i[k])
    got, new = reply["arrays"].to_torch_state_dict(), client_control(state, c_i)
    for k, p in net.named_parameters():
        assert torch.allclose(got[k].double(), p.detach(), **WIRE_ROUNDING), k
        assert torch.allclose(new[k], c_i[k] - c[k] + (x[k] - p.detach()) / (2 * lr), **FLOAT64), k


def test_a_state_from_a_discarded_attempt_is_dropped() -> None:
    """c_i written in round 2 is from an attempt the server discarded when round 2 comes (again):
    the client starts at c_i = 0; the same state is used in round 3."""
    c = controls(1)
    fresh = make_trainer(ScaffoldTrainer, make_data(), server_round=2).fit(
        global_content(server_round=2, control=ArrayRecord(c))
    )
    stale = make_trainer(ScaffoldTrainer, make_data(), state=with_client_control(c, 2), server_round=2).fit(
        global_content(server_round=2, control=ArrayRecord(c))
    )
    assert equal(stale["arrays"], fresh["arrays"])
    used = make_trainer(ScaffoldTrainer, make_data(), state=with_client_control(c, 2), server_round=3).fit(
        global_content(server_round=3, control=ArrayRecord(c))
    )
    assert used["metrics"]["correction-norm"] == 0.0  # c_i = c


# ---------------------------------------------------------------------------------------------- the server
def reply(arrays: dict, partition: int) -> Message:
    metrics = MetricRecord({"num-examples": 100, "partition-id": partition})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), dst_node_id=1, message_type="train")


def test_server_computes_delta_c_and_a_retried_round_starts_from_the_same_c(task_identity) -> None:
    cfg = validate({"method": "scaffold", "model": "mlp", "partition": "iid", "lr": 0.1, "batch-size": 64})
    strategy = ScaffoldStrategy(cfg)
    strategy.num_partitions = 10
    x = strategy.initial_arrays()
    strategy.sent_arrays = x
    sent = strategy.broadcast(1)["control"]
    assert all(not v.numpy().any() for v in sent.values())  # c = 0 at the start
    y = {k: v + 0.01 for k, v in x.to_torch_state_dict().items()}
    replies = [reply(y, 3)]
    steps = strategy.local_steps(replies[0])  # from partition 3's size, not from anything the reply says
    assert steps == int(np.ceil(len(client_indices(cfg, 10)[3][0]) / 64)) and 70 <= steps <= 80
    first = strategy.aggregate_arrays(1, replies)
    c1 = strategy.state_dict()
    for k in NAMES:  # c = 0 + (1/10) ((x - y) / (K lr) - 0)
        want = np.full(x[k].numpy().shape, -0.01 / (steps * 0.1) / 10, np.float32)
        np.testing.assert_allclose(c1[f"control/{k}"].numpy(), want, rtol=1e-4)
    # the round is retried: the same c goes out again and the same aggregate comes back
    assert all(np.array_equal(sent[k].numpy(), v.numpy()) for k, v in strategy.broadcast(1)["control"].items())
    again = strategy.aggregate_arrays(1, replies)
    assert equal(first, again) and all(torch.equal(c1[k], v) for k, v in strategy.state_dict().items())
    # round 2 starts from the c of round 1; a checkpoint restores it
    assert np.array_equal(strategy.broadcast(2)["control"][NAMES[0]].numpy(), c1[f"control/{NAMES[0]}"].numpy())
    other = ScaffoldStrategy(cfg)
    other.load_state_dict(strategy.state_dict())
    assert np.array_equal(other.broadcast(3)["control"][NAMES[0]].numpy(), c1[f"control/{NAMES[0]}"].numpy())


# ---------------------------------------------------------------------------------------------- + restricted softmax
def test_scaffold_rs_is_fedrs_when_the_controls_agree_and_uses_its_own_keys() -> None:
    c = controls(1)
    content = global_content(server_round=2, control=ArrayRecord(c))
    rs = make_trainer(
        ScaffoldRSTrainer, make_data(), state=with_client_control(c, 1), server_round=2, **{"scaffold-rs-alpha": 0.1}
    )
    fedrs = make_trainer(FedRSTrainer, make_data(), server_round=2, **{"fedrs-alpha": 0.1})
    got = rs.fit(content)
    assert equal(got["arrays"], fedrs.fit(global_content(server_round=2))["arrays"])
    assert torch.equal(rs.scale, fedrs_scale(make_data().train_counts, 0.1))
    assert got["metrics"]["observed-classes"] == 3.0 and "correction-norm" in got["metrics"]
    assert get_method("scaffold-rs").params.keys() == {
        "scaffold-rs-server-lr",
        "scaffold-rs-alpha",
        "scaffold-rs-scale",
        "scaffold-rs-tau",
    }


# ---------------------------------------------------------------------------------------------- in process
@pytest.mark.parametrize("method", ["scaffold", "scaffold-rs"])
def test_in_process_run_keeps_c_the_mean_of_the_clients_c_i_and_resumes_exactly(tmp_path, task_identity, method):
    cfg = {"method": method, "model": "mlp", "partition": "classes-per-client", "fraction-train": 0.5}
    full, _, grid = cut_and_resume(tmp_path, cfg, num_nodes=4, num_partitions=50)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["control-norm"] > 0 and rows[-1]["correction-norm"] > 0

    c = torch.load(full / "checkpoint.pt", weights_only=True)["strategy"]
    mean, held = mean_node_state(grid, CLIENT_CONTROL, controls(0), 3, 50)
    for k in NAMES:  # partitions without a node never trained: their c_i is 0
        assert torch.allclose(c[f"control/{k}"], mean[k], atol=1e-6), k
    assert held >= 2
