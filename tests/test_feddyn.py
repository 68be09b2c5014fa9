"""FedDyn: the linear and quadratic terms and the gradient state on hand computations, the
first-order condition behind the gradient state, the server's h and model, one round against the
authors' procedure, and in-process runs (h = (1/m) sum_k g_k, and resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from fedskew.client_app.feddyn import GRADIENT_STATE, FedDynTrainer
from fedskew.client_app.fedprox import FedProxTrainer
from fedskew.client_app.state import ClientState
from fedskew.losses.feddyn import feddyn_gradient_update, feddyn_penalty
from fedskew.models import build_model
from fedskew.strategies.aggregate import feddyn_server_update
from tests.harness import IN_FLOAT64, WIRE_ROUNDING, cut_and_resume, mean_node_state
from tests.test_trainers import global_content, make_data, make_trainer

LIKE = {k: p.detach() for k, p in build_model("mlp", "fashion-mnist").named_parameters()}


def test_penalty_and_gradient_state_on_a_hand_computation() -> None:
    """theta = [1, 2], theta^{t-1} = [0, 1], g_k = [0.5, -1], alpha = 0.1:
    -<g, theta - w> + alpha/2 ||theta - w||^2 = -(0.5 - 1) + 0.05 * 2 = 0.6, gradient -g + alpha (theta - w)."""
    theta = torch.tensor([1.0, 2.0], requires_grad=True)
    w, g = torch.tensor([0.0, 1.0]), torch.tensor([0.5, -1.0])
    value = feddyn_penalty([theta], [w], [g], 0.1)
    value.backward()
    assert float(value.detach()) == pytest.approx(0.6)
    assert torch.allclose(theta.grad, torch.tensor([-0.5 + 0.1, 1.0 + 0.1]))
    (new,) = feddyn_gradient_update([g], [theta.detach()], [w], 0.1)
    assert torch.allclose(new, torch.tensor([0.5 - 0.1, -1.0 - 0.1]))  # g - alpha (theta - w)


def test_gradient_state_is_the_local_gradient_at_the_local_minimiser() -> None:
    """L_k(theta) = ||theta - e||^2 / 2, minimised with the regulariser: the updated g_k equals
    grad L_k(theta_k^t) = theta_k^t - e (the first-order condition), round after round."""
    e, w, g, alpha = torch.tensor([3.0, -1.0]), torch.tensor([0.0, 0.0]), torch.zeros(2), 0.5
    for _ in range(3):
        theta = w.clone().requires_grad_(True)
        opt = torch.optim.SGD([theta], lr=0.1, momentum=0.9)
        for _ in range(500):
            opt.zero_grad()
            (0.5 * (theta - e).pow(2).sum() + feddyn_penalty([theta], [w], [g], alpha)).backward()
            opt.step()
        (g,) = feddyn_gradient_update([g], [theta.detach()], [w], alpha)
        assert torch.allclose(g, theta.detach() - e, atol=1e-5)
        w = theta.detach() + 0.3  # the next server model, anywhere


def test_server_h_and_model_on_a_hand_computation() -> None:
    """m = 4, alpha = 0.1, theta^{t-1} = 1, theta_1 = 2, theta_2 = 4, h = 0.5:
    h+ = 0.5 - 0.1/4 ((2 - 1) + (4 - 1)) = 0.4, theta^t = avg 3 - 0.4 / 0.1 = -1."""
    f = lambda v: {"w": np.array([v], np.float32)}  # noqa: E731
    h, theta = feddyn_server_update(f(0.5), f(1.0), [f(2.0), f(4.0)], f(3.0), 0.1, 4)
    np.testing.assert_allclose(h["w"], [0.4], rtol=1e-6)
    np.testing.assert_allclose(theta["w"], [-1.0], rtol=1e-5)
    assert h["w"].dtype == theta["w"].dtype == np.float32


def test_first_round_is_fedprox_then_the_linear_term_acts() -> None:
    """g_k = 0 in the first round: the objective is FedProx's with mu = alpha. With the g_k the
    first round stored, the second round differs from FedProx; train-loss is the cross-entropy."""
    state = RecordDict()
    cfg = {"feddyn-alpha": 0.1, "fedprox-mu": 0.1}
    dyn = make_trainer(FedDynTrainer, make_data(), state=state, **cfg).fit(global_content())
    prox = make_trainer(FedProxTrainer, make_data(), **cfg).fit(global_content())
    a, b = dyn["arrays"].to_torch_state_dict(), prox["arrays"].to_torch_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    g = ClientState(state, 64, 0).load_round_tensors(GRADIENT_STATE, LIKE, 2)
    x = global_content()["arrays"].to_torch_state_dict()
    for k in LIKE:  # g_1 = 0 - alpha (theta_1 - theta^0)
        assert torch.allclose(g[k], -0.1 * (a[k] - x[k]), atol=1e-7), k
    assert dyn["metrics"]["feddyn-gradient-norm"] > 0
    dyn2 = make_trainer(FedDynTrainer, make_data(), state=state, server_round=2, **cfg).fit(
        global_content(server_round=2)
    )
    prox2 = make_trainer(FedProxTrainer, make_data(), server_round=2, **cfg).fit(global_content(server_round=2))
    a, b = dyn2["arrays"].to_torch_state_dict(), prox2["arrays"].to_torch_state_dict()
    assert not all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert 0.0 < dyn2["metrics"]["train-loss"] < 5.0


def test_one_round_equals_the_authors_procedure() -> None:
    """Two full-batch steps against the authors' `train_feddyn_mdl` (`alpemreacar/FedDyn` at 48a19fac,
    utils_general.py), written out here: plain SGD with weight decay alpha + weight_decay on
    CE + alpha <theta, -theta^{t-1} + lambda_k>, lambda_k = -g_k / alpha."""
    alpha, wd, lr = 0.1, 1e-3, 0.05
    g = torch.Generator().manual_seed(3)
    grads = {k: 0.01 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in LIKE.items()}
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(GRADIENT_STATE, grads, 1)
    cfg = {"feddyn-alpha": alpha, "lr": lr, "momentum": 0.0, "weight-decay": wd, "batch-size": 80, "local-epochs": 2}
    data, content = make_data(), global_content(server_round=2)
    cfg.update(IN_FLOAT64)  # both sides in float64: the trainer shuffles its batch
    got = make_trainer(FedDynTrainer, data, state=state, server_round=2, **cfg).fit(content)["arrays"]

    net = build_model("mlp", "fashion-mnist").double()
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    w = {k: p.detach().clone() for k, p in net.named_parameters()}
    opt = torch.optim.SGD(net.parameters(), lr=lr, weight_decay=alpha + wd)
    for _ in range(2):
        linear = sum((p * (-w[k] - grads[k] / alpha)).sum() for k, p in net.named_parameters())
        opt.zero_grad()
        (F.cross_entropy(net(data.x_train.double()), data.y_train) + alpha * linear).backward()
        opt.step()
    got = got.to_torch_state_dict()
    assert all(torch.allclose(got[k].double(), p.detach(), **WIRE_ROUNDING) for k, p in net.named_parameters())


def test_in_process_run_keeps_h_the_mean_of_the_gradient_states_and_resumes_exactly(tmp_path, task_identity) -> None:
    cfg = {"method": "feddyn", "model": "mlp", "partition": "classes-per-client", "fraction-train": 0.5}
    full, _, grid = cut_and_resume(tmp_path, cfg, num_nodes=4, num_partitions=50)

    h = torch.load(full / "checkpoint.pt", weights_only=True)["strategy"]
    mean, held = mean_node_state(grid, GRADIENT_STATE, LIKE, 3, 50)
    assert held >= 2
    for k in LIKE:  # h = -alpha/m sum of every accepted (theta_k - theta^{t-1}) = (1/m) sum_k g_k
        assert torch.allclose(h[f"h/{k}"], mean[k], atol=1e-7), k


def authors_feddyn_round(content, data, grads, alpha, wd, lr, steps, max_norm) -> dict[str, torch.Tensor]:
    """`steps` full-batch steps of `train_feddyn_mdl` (`alpemreacar/FedDyn` at 48a19fac, utils_general.py;
    the same in `gaoliang13/FedDC` utils_general.py `train_model_alg`), written out in float64: the loss
    CE + alpha <theta, -theta^{t-1} + lambda_k> (lambda_k = -g_k / alpha), then `clip_grad_norm_` of its
    gradient at `max_norm` (0: none), then plain SGD with weight decay alpha + weight_decay, so the
    decay's alpha theta is outside the clip."""
    net = build_model("mlp", "fashion-mnist").double()
    net.load_state_dict(content["arrays"].to_torch_state_dict())
    w = {k: p.detach().clone() for k, p in net.named_parameters()}
    lam = {k: -v.double() / alpha for k, v in grads.items()}
    opt = torch.optim.SGD(net.parameters(), lr=lr, weight_decay=alpha + wd)
    for _ in range(steps):
        linear = sum((p * (-w[k] + lam[k])).sum() for k, p in net.named_parameters())
        opt.zero_grad()
        (F.cross_entropy(net(data.x_train.double()), data.y_train) + alpha * linear).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
    return {k: p.detach() for k, p in net.named_parameters()}


@pytest.mark.parametrize("clip", [0.1, 1000.0])
def test_grad_clip_clips_what_the_authors_code_clips(clip: float) -> None:
    """`grad-clip` acts on the gradient of CE + alpha <theta, -theta^{t-1} + lambda_k>, not on the
    decay's alpha theta: two full-batch steps against the code's arithmetic in float64, at a clip that
    binds (0.1; the clipped vector's norm is about 4) and one that does not (1000: the unclipped
    round). Clipping the whole gradient, alpha (theta - theta^{t-1}) included, moved the model by 7e-4
    from the code's at 0.1; now 1e-8, as without a binding clip."""
    alpha, wd, lr = 0.1, 1e-3, 0.05
    g = torch.Generator().manual_seed(3)
    grads = {k: 0.01 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in LIKE.items()}
    state = RecordDict()
    ClientState(state, 64, 0).save_round_tensors(GRADIENT_STATE, grads, 1)
    cfg = {"feddyn-alpha": alpha, "lr": lr, "momentum": 0.0, "weight-decay": wd, "batch-size": 80, "local-epochs": 2}
    cfg.update({"grad-clip": clip, **IN_FLOAT64})  # the trainer in float64 too: it shuffles its batch
    data, content = make_data(), global_content(server_round=2)
    got = make_trainer(FedDynTrainer, data, state=state, server_round=2, **cfg).fit(content)
    got = got["arrays"].to_torch_state_dict()
    want = authors_feddyn_round(content, data, grads, alpha, wd, lr, 2, clip)
    gap = max(float((got[k].double() - want[k]).abs().max()) for k in want)
    assert all(torch.allclose(got[k].double(), want[k], **WIRE_ROUNDING) for k in want), gap
    if clip > 100:  # the clip does not bind: the round is the unclipped one
        plain = authors_feddyn_round(content, data, grads, alpha, wd, lr, 2, 0.0)
        assert all(torch.equal(plain[k], want[k]) for k in want)
