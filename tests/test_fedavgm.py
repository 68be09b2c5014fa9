"""FedAvgM: the server step against torch's momentum SGD on the pseudo-gradient, FedAvg when beta = 0,
and in-process runs: at eta = 1 equal to FedAvg in round 1 and at beta = 0, apart from it once v
carries over; at the default eta = 0.1 apart from round 1."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedskew.strategies.aggregate import server_momentum_step
from tests.harness import run_in_process


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 2)).astype(np.float32), "bn.num_batches_tracked": np.array(7 + seed)}


@pytest.mark.parametrize(("lr", "beta"), [(1.0, 0.9), (0.5, 0.0), (0.3, 0.99)])
def test_the_server_step_is_torchs_momentum_sgd_on_the_pseudo_gradient(lr: float, beta: float) -> None:
    """x - eta v with v <- beta v + (x - avg), as `torch.optim.SGD(momentum=beta)` steps on the
    gradient x - avg (its first buffer is the gradient itself, our v starts at 0: the same)."""
    x = {"w": np.random.default_rng(9).normal(size=(3, 2))}
    p = torch.nn.Parameter(torch.from_numpy(x["w"].copy()))
    opt = torch.optim.SGD([p], lr=lr, momentum=beta)
    v = {"w": np.zeros((3, 2), np.float32)}
    for r in range(4):
        avg = arrays(r)
        p.grad = p.detach() - torch.from_numpy(avg["w"]).double()
        opt.step()
        new, v = server_momentum_step(x, avg, v, lr, beta)
        np.testing.assert_allclose(new["w"], p.detach().numpy().astype(np.float32), rtol=1e-6, atol=1e-6)
        assert new["w"].dtype == np.float32 and new["bn.num_batches_tracked"] == avg["bn.num_batches_tracked"]
        x = {"w": p.detach().numpy().copy()}


def test_no_momentum_and_a_unit_step_give_the_average_exactly() -> None:
    x, avg = arrays(0), arrays(1)
    new, v = server_momentum_step(x, avg, {"w": np.ones((3, 2), np.float32)}, 1.0, 0.0)
    assert np.array_equal(new["w"], avg["w"]) and np.array_equal(v["w"], (x["w"] - avg["w"]).astype(np.float32))


def test_in_process_runs_part_from_fedavg_once_momentum_carries_over(tmp_path, task_identity) -> None:
    cfg = {"model": "mlp", "partition": "classes-per-client", "fraction-train": 0.5, "num-server-rounds": 3}
    cfg["out-dir"] = str(tmp_path)
    runs = {
        "avg": {"method": "fedavg"},
        "m0": {"method": "fedavgm", "fedavgm-server-momentum": 0.0, "fedavgm-server-lr": 1.0},
        "m": {"method": "fedavgm", "fedavgm-server-lr": 1.0},
        "default": {"method": "fedavgm"},
    }
    rows = {}
    for name, extra in runs.items():
        run_in_process({**cfg, **extra, "run-name": name}, 6, None, 60)
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    acc = {name: [r["global-accuracy"] for r in rs] for name, rs in rows.items()}
    assert acc["m0"] == acc["avg"]  # beta = 0, eta = 1: FedAvg to the last digit
    assert acc["m"][0] == acc["avg"][0] and acc["m"][1:] != acc["avg"][1:]  # round 1's v is its Delta
    assert all(r["momentum-norm"] > 0 for r in rows["m"])
    assert acc["default"][0] != acc["avg"][0]  # eta = 0.1: round 1 takes a tenth of FedAvg's step


def test_the_momentum_is_checkpointed_and_restored() -> None:
    from fedskew.config import validate
    from fedskew.strategies.fedavgm import FedAvgMStrategy

    cfg = validate({"method": "fedavgm", "model": "mlp"})
    a, b = FedAvgMStrategy(cfg), FedAvgMStrategy(cfg)
    a.momentum.value = {k: np.full_like(v, 0.5) for k, v in a.momentum.value.items()}
    state = a.state_dict()
    assert state and all(k.startswith("momentum/") for k in state)
    b.load_state_dict(state)
    assert all(np.array_equal(b.momentum.before(1)[k], v) for k, v in a.momentum.value.items())
