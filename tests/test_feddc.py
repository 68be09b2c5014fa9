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
from fedskew.losses.scaffold import scaffold_control_deltas
from fedskew.methods.feddc import FEDDC_UPDATE
from fedskew.models import build_model
from fedskew.strategies.aggregate import scaffold_control_update, weighted_average
from fedskew.strategies.base import arrays_to_numpy, numpy_to_arrays
from fedskew.strategies.feddc import FedDCStrategy
from tests.harness import FLOAT64, IN_FLOAT64, WIRE_ROUNDING, cut_and_resume, mean_node_state, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer

LIKE = {k: p.detach() for k, p in build_model("mlp", "fashion-mnist").named_parameters()}


def vectors(seed: int, scale: float = 0.01, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g, dtype=dtype) for k, v in LIKE.items()}


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
    h, c_i, c = vectors(1, dtype=torch.float64), vectors(2, dtype=torch.float64), vectors(3)
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(DRIFT, h, 1)
    ClientState(state, 64, 0).save_round_tensors(CLIENT_CONTROL, c_i, 1)
    cfg = {"feddc-alpha": alpha, "lr": lr, "momentum": 0.0, "weight-decay": wd, "batch-size": 80, "local-epochs": 2}
    data, content = make_data(), global_content(server_round=2, control=ArrayRecord(c))
    cfg.update(IN_FLOAT64)  # both sides in float64: the trainer shuffles its batch
    reply = make_trainer(FedDCTrainer, data, state=state, server_round=2, **cfg).fit(content)

    net = build_model("mlp", "fashion-mnist").double()
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    w = {k: p.detach().clone() for k, p in net.named_parameters()}
    opt = torch.optim.SGD(net.parameters(), lr=lr, weight_decay=wd)
    for _ in range(2):
        cp = sum(alpha / 2 * (p - (w[k] - h[k])).pow(2).sum() for k, p in net.named_parameters())
        cg = sum((p * (c[k] - c_i[k])).sum() for k, p in net.named_parameters())
        opt.zero_grad()
        (F.cross_entropy(net(data.x_train.double()), data.y_train) + cp + cg).backward()
        opt.step()
    theta = {k: p.detach() for k, p in net.named_parameters()}
    upload, update = reply["arrays"].to_torch_state_dict(), reply[FEDDC_UPDATE].to_torch_state_dict()
    saved, like = ClientState(state, 64, 0), {k: v.double() for k, v in LIKE.items()}
    new_h, new_c = saved.load_round_tensors(DRIFT, like, 3), saved.load_round_tensors(CLIENT_CONTROL, like, 3)
    for k in LIKE:  # the uploads rounded to float32 (the wire), the kept state in float64
        assert torch.allclose(update[k].double(), theta[k] - w[k], **WIRE_ROUNDING), k
        assert torch.allclose(new_h[k], h[k] + theta[k] - w[k], **FLOAT64), k
        assert torch.allclose(upload[k].double(), theta[k] + new_h[k], **WIRE_ROUNDING), k
        assert torch.allclose(new_c[k], c_i[k] - c[k] + (w[k] - theta[k]) / (2 * lr), **FLOAT64), k
    assert reply["metrics"]["feddc-drift-norm"] > 0


def feddc_replies(x: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]], drifts, parts) -> list[Message]:
    """Replies of clients `parts` whose local update is `updates[i]` and drift after it `drifts[i]`:
    upload theta_i + h_i, `feddc-update` theta_i - w."""
    replies = []
    for p, u, h in zip(parts, updates, drifts, strict=True):
        upload = {k: v + u[k] + h[k] if k in u else v for k, v in x.items()}
        records = {
            "arrays": ArrayRecord({k: torch.from_numpy(v.astype(np.float32)) for k, v in upload.items()}),
            FEDDC_UPDATE: ArrayRecord({k: torch.from_numpy(v) for k, v in u.items()}),
            "metrics": MetricRecord({"num-examples": 100, "partition-id": p}),
        }
        replies.append(Message(RecordDict(records), dst_node_id=1, message_type="train"))
    return replies


def test_server_adds_the_mean_drift_of_all_clients_and_updates_c_from_the_local_updates(task_identity) -> None:
    """Two rounds of 2 of 10 clients: w = mean of the round's theta_i + (1/10) sum_j h_j over all
    clients (the code's `avg_mdl_param_sel + np.mean(parameter_drifts)`), not the mean of the round's
    uploads theta_i + h_i; c is SCAFFOLD's from the local updates."""
    cfg = validate({"method": "feddc", "model": "mlp", "partition": "iid", "lr": 0.1})
    strategy = FedDCStrategy(cfg)
    strategy.num_partitions = 10
    strategy.sent_arrays = strategy.initial_arrays()
    rng = np.random.default_rng(0)
    drifts = {p: {k: np.zeros(v.shape) for k, v in LIKE.items()} for p in range(10)}  # the clients' h_j
    for server_round, parts in ((1, (1, 2)), (2, (2, 3))):
        x = arrays_to_numpy(strategy.sent_arrays)
        c0 = {k: v.numpy() for k, v in strategy.broadcast(server_round)["control"].items()}
        updates = [{k: 0.01 * rng.normal(size=x[k].shape).astype(np.float32) for k in LIKE} for _ in parts]
        for p, u in zip(parts, updates, strict=True):
            drifts[p] = {k: drifts[p][k] + u[k] for k in LIKE}
        replies = feddc_replies(x, updates, [drifts[p] for p in parts], parts)
        got = arrays_to_numpy(strategy.aggregate_arrays(server_round, replies))
        local = [{k: x[k] + u[k] for k in u} for u in updates]
        mean_local = weighted_average(local, [100, 100])
        for k in LIKE:
            want = mean_local[k] + sum(drifts[j][k] for j in range(10)) / 10
            assert np.allclose(got[k], want, atol=1e-6), k
        uploads = weighted_average([arrays_to_numpy(m.content["arrays"]) for m in replies], [100, 100])
        assert not all(np.allclose(uploads[k], got[k], atol=1e-4) for k in LIKE)  # partial: not their mean
        steps = [strategy.local_steps(m) for m in replies]
        c = scaffold_control_update(c0, scaffold_control_deltas(c0, x, local, steps, 0.1), 10)
        state = strategy.state_dict()
        assert all(np.allclose(state[f"control/{k}"].numpy(), c[k], atol=1e-6) for k in LIKE)
        # the diagnostic model is the average of the theta_i alone: the global model without the drift
        [(name, model)] = strategy.diagnostic_models(numpy_to_arrays(got)).items()
        assert name == "feddc-local-average"
        assert all(np.allclose(model.state_dict()[k].numpy(), mean_local[k], atol=1e-6) for k in mean_local)
        strategy.sent_arrays = numpy_to_arrays(got)
    # H is checkpointed: a strategy loaded from the state gives the same next model
    again = FedDCStrategy(cfg)
    again.load_state_dict(strategy.state_dict())
    assert all(np.array_equal(again.drift_sum.value[k], strategy.drift_sum.value[k]) for k in LIKE)


def test_under_full_participation_the_server_model_is_the_mean_of_the_uploads(task_identity) -> None:
    """Every client in every round: sum_j h_j / N over all clients is the round's mean drift, so w is
    the plain mean of the uploads theta_i + h_i (FedDC's "average of the drift-corrected models")."""
    cfg = validate({"method": "feddc", "model": "mlp", "partition": "iid", "aggregation-weights": "uniform"})
    strategy = FedDCStrategy(cfg)
    strategy.num_partitions = 3
    strategy.sent_arrays = strategy.initial_arrays()
    rng = np.random.default_rng(1)
    drifts = [{k: np.zeros(v.shape) for k, v in LIKE.items()} for _ in range(3)]
    for server_round in (1, 2):
        x = arrays_to_numpy(strategy.sent_arrays)
        updates = [{k: 0.01 * rng.normal(size=x[k].shape).astype(np.float32) for k in LIKE} for _ in range(3)]
        drifts = [{k: h[k] + u[k] for k in LIKE} for h, u in zip(drifts, updates, strict=True)]
        replies = feddc_replies(x, updates, drifts, (0, 1, 2))
        got = arrays_to_numpy(strategy.aggregate_arrays(server_round, replies))
        want = weighted_average([arrays_to_numpy(m.content["arrays"]) for m in replies], [1, 1, 1])
        assert all(np.allclose(got[k], want[k], atol=1e-5) for k in want)
        strategy.sent_arrays = numpy_to_arrays(got)


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


def authors_feddc_round(content, data, h, c_i, c, alpha, wd, lr, steps, max_norm) -> dict[str, torch.Tensor]:
    """`steps` full-batch steps of `train_model_FedDC` (`gaoliang13/FedDC` at 13440c23, utils_general.py),
    written out in float64: the loss CE + alpha/2 ||theta - (w - h_i)||^2 + <theta, c - c_i> (the
    correction is a linear term of the loss), then `clip_grad_norm_` of its whole gradient at
    `max_norm` (the code's max_norm = 10; 0: none), then plain SGD with weight decay."""
    net = build_model("mlp", "fashion-mnist").double()
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    w = {k: p.detach().clone() for k, p in net.named_parameters()}
    h, diff = ({k: v.double() for k, v in t.items()} for t in (h, {k: c[k] - c_i[k] for k in c}))
    opt = torch.optim.SGD(net.parameters(), lr=lr, weight_decay=wd)
    for _ in range(steps):
        cp = sum(alpha / 2 * (p - (w[k] - h[k])).pow(2).sum() for k, p in net.named_parameters())
        cg = sum((p * diff[k]).sum() for k, p in net.named_parameters())
        opt.zero_grad()
        (F.cross_entropy(net(data.x_train.double()), data.y_train) + cp + cg).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
    return {k: p.detach() for k, p in net.named_parameters()}


@pytest.mark.parametrize("clip", [0.1, 1000.0])
def test_grad_clip_clips_the_correction_with_the_loss_gradient(clip: float) -> None:
    """`grad-clip` clips the gradient of the loss and the correction c - c_i together, as the code's
    `clip_grad_norm_` after `loss.backward()` does: two full-batch steps against the code's arithmetic
    in float64, at a clip that binds (0.1; ||grad CE|| about 4, ||c - c_i|| about 6) and one that does
    not (1000: the unclipped round). Applying the correction after the clipped step instead, unclipped,
    moved the model by 6e-3 from the code's at 0.1; now 1e-8, as without a binding clip."""
    alpha, wd, lr = 0.1, 1e-3, 0.05
    h, c_i, c = vectors(1, dtype=torch.float64), vectors(2, dtype=torch.float64), vectors(3)
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(DRIFT, h, 1)
    ClientState(state, 64, 0).save_round_tensors(CLIENT_CONTROL, c_i, 1)
    cfg = {"feddc-alpha": alpha, "lr": lr, "momentum": 0.0, "weight-decay": wd, "batch-size": 80, "local-epochs": 2}
    cfg.update({"grad-clip": clip, **IN_FLOAT64})  # the trainer in float64 too: it shuffles its batch
    data, content = make_data(), global_content(server_round=2, control=ArrayRecord(c))
    reply = make_trainer(FedDCTrainer, data, state=state, server_round=2, **cfg).fit(content)
    got = reply[FEDDC_UPDATE].to_torch_state_dict()  # theta - w, rounded to float32 on the wire
    want = authors_feddc_round(content, data, h, c_i, c, alpha, wd, lr, 2, clip)
    w = content["arrays"].to_torch_state_dict()
    gap = max(float((got[k].double() + w[k].double() - want[k]).abs().max()) for k in want)
    assert all(torch.allclose(got[k].double(), want[k] - w[k].double(), **WIRE_ROUNDING) for k in want), gap
    if clip > 100:  # the clip does not bind: the round is the unclipped one
        plain = authors_feddc_round(content, data, h, c_i, c, alpha, wd, lr, 2, 0.0)
        assert all(torch.equal(plain[k], want[k]) for k in want)
