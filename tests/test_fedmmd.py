"""FedMMD: its MMD is the FedRS authors' (the code behind FedRS's FedMMD rows), lambda = 0 is FedAvg,
the term keeps the local features near the global model's, and a run through the real apps."""

from __future__ import annotations

import json

import torch

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedmmd import FedMMDTrainer
from fedskew.losses import mmd_multi_gaussian
from fedskew.models import build_model
from tests.harness import run_in_process
from tests.test_trainers import global_content, make_data, make_trainer


def test_the_mmd_is_the_one_fedrs_ran_fedmmd_with() -> None:
    """Derived from lxcnju/FedRepo at 617ee015 (`tools.py`: `guassian_kernel`, `mmd_rbf_noaccelerate`,
    called by `algorithms/fedreg.py` with `reg_way="fedmmd"` on the two models' features). In float64:
    the MMD is a difference of kernel sums, whose float32 rounding (by the CPU's vector width) is a
    large share of it; in float64 the formula is the same to 1e-12 on any CPU. The authors add 1e-8 to
    the bandwidth (fedskew only keeps it above 1e-12): that moves the MMD by less than 1e-6."""
    g = torch.Generator().manual_seed(0)
    source = torch.randn(12, 6, generator=g, dtype=torch.float64)
    target = torch.randn(12, 6, generator=g, dtype=torch.float64) + 0.5
    total = torch.cat([source, target])
    l2 = ((total.unsqueeze(1) - total.unsqueeze(0)) ** 2).sum(2)
    n, b = len(total), len(source)

    def authors(eps: float) -> torch.Tensor:
        bandwidth = (l2.sum() / (n**2 - n) + eps) / 2.0 ** (5 // 2)
        kernels = sum(torch.exp(-l2 / (bandwidth * 2.0**i)) for i in range(5))
        return torch.mean(kernels[:b, :b] + kernels[b:, b:] - kernels[:b, b:] - kernels[b:, :b])

    ours = mmd_multi_gaussian(source, target)
    assert torch.allclose(ours, authors(0.0), rtol=1e-12, atol=0)
    assert abs(float(ours - authors(1e-8))) < 1e-6


def feature_mmd(reply_arrays, global_arrays, x: torch.Tensor) -> float:
    """The MMD between the trained and the global model's features on `x`."""
    local, glob = build_model("mlp", "fashion-mnist"), build_model("mlp", "fashion-mnist")
    local.load_state_dict(reply_arrays)
    glob.load_state_dict(global_arrays)
    with torch.no_grad():
        return mmd_multi_gaussian(local.features(x), glob.features(x)).item()


def test_lambda_zero_is_fedavg_and_the_term_keeps_features_near_the_global_models() -> None:
    """Measured here: after two epochs the features' MMD to the global model is 3.08 with CE alone and
    0.18 with lambda = 1."""
    data, content = make_data(), global_content()
    sent = content["arrays"].to_torch_state_dict()
    avg = make_trainer(FedAvgTrainer, data).fit(global_content())
    zero = make_trainer(FedMMDTrainer, data, **{"fedmmd-lambda": 0.0}).fit(global_content())
    strong = make_trainer(FedMMDTrainer, data, **{"fedmmd-lambda": 1.0}).fit(global_content())
    a, z = avg["arrays"].to_torch_state_dict(), zero["arrays"].to_torch_state_dict()
    assert all(torch.equal(v, a[k]) for k, v in z.items())
    assert zero["metrics"]["mmd-loss"] == 0.0 and strong["metrics"]["mmd-loss"] > 0
    drift_ce = feature_mmd(a, sent, data.x_train)
    drift_mmd = feature_mmd(strong["arrays"].to_torch_state_dict(), sent, data.x_train)
    assert drift_mmd < drift_ce / 5


def test_fedmmd_runs_in_process(tmp_path, task_identity) -> None:
    cfg = {"method": "fedmmd", "model": "mlp", "num-server-rounds": 2, "fraction-train": 1.0}
    run_in_process({**cfg, "out-dir": str(tmp_path), "run-name": "fedmmd"}, 4, num_partitions=50)
    rows = [json.loads(line) for line in (tmp_path / "fedmmd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["replies"] for r in rows] == [4, 4] and all(r["failures"] == 0 for r in rows)
    assert all(r["mmd-loss"] > 0 for r in rows) and rows[-1]["global-accuracy"] > 0.2
