"""FedDC: the drift penalty and drift on a hand computation, one round against the authors'
procedure (penalty, gradient correction, drift, control update and the drift-corrected upload), the
server's average and control variate, and in-process runs (c = (1/N) sum_i c_i, and resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.feddc import DRIFT, FedDCTrainer
from fedskew.client_app.scaffold import CLIENT_CONTROL
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.losses import proximal_term
from fedskew.losses.feddc import drift_update, penalty_target
from fedskew.models import build_model
from fedskew.strategies.aggregate import scaffold_control_deltas, scaffold_control_update, weighted_average
from fedskew.strategies.base import arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.feddc import FedDCStrategy
from fedskew.wire import FEDDC_UPDATE
from tests.harness import cut_and_resume, mean_node_state, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer

LIKE = {k: p.detach() for k, p in build_model("mlp", "fashion-mnist").named_parameters()}


def vectors(seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in LIKE.items()}


def test_drift_penalty_and_drift_on_a_hand_computation() -> None:
    """theta = 1, w = 0.5, h = 0.2, alpha = 0.1: alpha/2 (theta + h - w)^2 = 0.05 * 0.49, gradient
    0.1 * 0.7; after training h = 0.2 + (1 - 0.5) = 0.7."""
    theta, w, h = torch.tensor([1.0], requires_grad=True), torch.tensor([0.5]), torch.tensor([0.2])
    value = proximal_term([theta], penalty_target([w], [h]), 0.1)
    value.backward()
    assert float(value.detach()) == pytest.approx(0.05 * 0.49)
    assert torch.allclose(theta.grad, torch.tensor([0.07]))
    assert torch.allclose(drift_update([h], [theta.detach()], [w])[0], torch.tensor([0.7]))


def test_one_round_equals_the_authors_procedure() -> None:
    """Two full-batch steps against `gaoliang13/FedDC` at 13440c23, written out here: plain SGD with
    weight decay on CE + alpha/2 ||theta - (w - h_i)||^2 + <theta, c - c_i> (`train_model_FedDC`), then
    h_i += theta - w, c_i = c_i - c + (w - theta) / (K lr) (`train_FedDC`, beta = 1 / (K lr)); the
    upload is theta + h_i and the `feddc-update` theta - w."""
    alpha, wd, lr = 0.1, 1e-3, 0.05
    h, c_i, c = vectors(1), vectors(2), vectors(3)
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(DRIFT, h, 1)
    ClientState(state, 64, 0).save_round_tensors(CLIENT_CONTROL, c_i, 1)
    cfg = {"feddc-alpha": alpha, "lr": lr, "momentum": 0.0, "weight-decay": wd, "batch-size": 80, "local-epochs": 2}
    data, content = make_data(), global_content(server_round=2, control=ArrayRecord(c))
    reply = make_trainer(FedDCTrainer, data, state=state, server_round=2, **cfg).fit(content)

    net = build_model("mlp", "fashion-mnist")
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    w = {k: p.detach().clone() for k, p in net.named_parameters()}
    opt = torch.optim.SGD(net.parameters(), lr=lr, weight_decay=wd)
    for _ in range(2):
        cp = sum(alpha / 2 * (p - (w[k] - h[k])).pow(2).sum() for k, p in net.named_parameters())
        cg = sum((p * (c[k] - c_i[k])).sum() for k, p in net.named_parameters())
        opt.zero_grad()
        (F.cross_entropy(net(data.x_train), data.y_train) + cp + cg).backward()
        opt.step()
    theta = {k: p.detach() for k, p in net.named_parameters()}
    upload, update = reply["arrays"].to_torch_state_dict(), reply[FEDDC_UPDATE].to_torch_state_dict()
    saved = ClientState(state, 64, 0)
    new_h, new_c = saved.load_round_tensors(DRIFT, LIKE, 3), saved.load_round_tensors(CLIENT_CONTROL, LIKE, 3)
    for k in LIKE:
        assert torch.allclose(update[k], theta[k] - w[k], atol=1e-6), k
        assert torch.allclose(new_h[k], h[k] + theta[k] - w[k], atol=1e-6), k
        assert torch.allclose(upload[k], theta[k] + new_h[k], atol=1e-6), k
        assert torch.allclose(new_c[k], c_i[k] - c[k] + (w[k] - theta[k]) / (2 * lr), atol=1e-4), k
    assert reply["metrics"]["feddc-drift-norm"] > 0


def test_server_averages_the_drift_corrected_models_and_updates_c_from_the_local_updates(task_identity) -> None:
    cfg = validate({"method": "feddc", "model": "mlp", "partition": "iid", "lr": 0.1})
    strategy = FedDCStrategy(cfg)
    strategy.num_partitions = 10
    strategy.sent_arrays = strategy.initial_arrays()
    x = arrays_to_numpy(strategy.sent_arrays)
    c0 = {k: v.numpy() for k, v in strategy.broadcast(1)["control"].items()}
    rng = np.random.default_rng(0)
    uploads = [{k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in x.items()} for _ in range(2)]
    updates = [{k: 0.01 * rng.normal(size=x[k].shape).astype(np.float32) for k in LIKE} for _ in range(2)]
    replies = [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: torch.from_numpy(v) for k, v in up.items()}),
                    FEDDC_UPDATE: ArrayRecord({k: torch.from_numpy(v) for k, v in u.items()}),
                    "metrics": MetricRecord({"num-examples": 100, "partition-id": p}),
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        for p, up, u in zip((1, 2), uploads, updates, strict=True)
    ]
    got = arrays_to_numpy(strategy.aggregate_arrays(1, replies))
    want = weighted_average(uploads, [100, 100])  # the uploads theta_i + h_i, no server step
    assert all(np.array_equal(got[k], want[k]) for k in want)
    steps = [strategy.local_steps(m) for m in replies]
    local = [{k: x[k] + u[k] for k in u} for u in updates]
    c = scaffold_control_update(c0, scaffold_control_deltas(c0, x, local, steps, 0.1), 10)
    state = strategy.state_dict()
    assert all(np.allclose(state[f"control/{k}"].numpy(), c[k], atol=1e-6) for k in LIKE)
    # the diagnostic model is the average of the theta_i alone: the global model without the drift
    [(name, model)] = strategy.diagnostic_models(numpy_to_arrays(got)).items()
    mean_local = weighted_average(local, [100, 100])
    assert name == "feddc-local-average"
    assert all(np.allclose(model.state_dict()[k].numpy(), mean_local[k], atol=1e-6) for k in mean_local)
    assert not all(np.allclose(mean_local[k], got[k]) for k in mean_local)


def test_a_run_logs_the_drift_and_the_local_average_beside_the_global_model(tmp_path, task_identity) -> None:
    """Every round's row holds the clients' mean ||h_i|| and the accuracy of the theta_i's average,
    which the authors' code evaluates beside theta-bar + h-bar."""
    cfg = {"method": "feddc", "model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 2}
    run_in_process({**cfg, "out-dir": str(tmp_path), "run-name": "r"}, 3, num_partitions=3)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    drift = [row["feddc-drift-norm"] for row in rows]
    assert all(d > 0 for d in drift) and drift[0] != drift[1]
    assert all(0 <= row["feddc-local-average-accuracy"] <= 1 for row in rows)
    assert rows[0]["feddc-local-average-accuracy"] != rows[0]["global-accuracy"]


def test_in_process_run_keeps_c_the_mean_of_the_clients_c_i_and_resumes_exactly(tmp_path, task_identity) -> None:
    cfg = {"method": "feddc", "model": "mlp", "partition": "classes-per-client", "fraction-train": 0.5}
    full, _, grid = cut_and_resume(tmp_path, cfg, num_nodes=4, num_partitions=50)

    c = torch.load(full / "checkpoint.pt", weights_only=True)["strategy"]
    mean, held = mean_node_state(grid, CLIENT_CONTROL, LIKE, 3, 50)
    assert held >= 2
    for k in LIKE:
        assert torch.allclose(c[f"control/{k}"], mean[k], atol=1e-6), k
