"""FedNova: a_i against torch's momentum SGD and the authors' recursion, equality with FedAvg when
every client takes the same number of steps, the paper's direction on quadratics when they do not,
the server's own step counts, and in-process runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedskew.config import validate
from fedskew.strategies.aggregate import fednova_normalizer, normalized_average, weighted_average
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.strategies.fednova import FedNovaStrategy
from fedskew.training import steps_per_round, train_epochs
from tests.harness import run_in_process


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("steps", [1, 2, 7, 40])
def test_normalizer_is_the_weight_momentum_sgd_gives_the_gradients(steps: int, momentum: float) -> None:
    """a_i = displacement / (lr g) after tau steps of torch's SGD on a constant gradient g, and the
    authors' recursion (`JYWa/FedNova` at 47b4e096, distoptim/FedNova.py: counter = counter rho + 1,
    a += counter)."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad()
        p.sum().backward()
        opt.step()
    a = fednova_normalizer(steps, momentum)
    assert -float(p.detach()) / 0.1 == pytest.approx(a, rel=1e-12)
    counter, vec = 0.0, 0.0
    for _ in range(steps):
        counter = counter * momentum + 1
        vec += counter
    assert a == pytest.approx(vec if momentum else steps, rel=1e-12)


@pytest.mark.parametrize(("n", "epochs", "batch"), [(80, 2, 16), (81, 1, 16), (5, 3, 64), (64, 1, 64)])
def test_servers_step_count_is_what_local_training_takes(n: int, epochs: int, batch: int) -> None:
    model = torch.nn.Linear(2, 2)
    x, y = torch.randn(n, 2), torch.randint(0, 2, (n,))
    loss = lambda m, xb, yb: torch.nn.functional.cross_entropy(m(xb), yb)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train_epochs(model, x, y, loss, opt, epochs, batch, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert stats["train-steps"] == steps_per_round(n, epochs, batch)


def models(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(3, 2)).astype(np.float32)} for _ in range(n)]


def test_equals_fedavg_when_every_client_takes_the_same_number_of_steps() -> None:
    (x,), ys, weights = models(0, 1), models(1, 3), [1.0, 2.0, 5.0]
    for a in (1.0, 10.0, fednova_normalizer(25, 0.9)):
        np.testing.assert_allclose(
            normalized_average(x, ys, weights, [a] * 3)["w"], weighted_average(ys, weights)["w"], atol=1e-6
        )
    # unequal steps: no longer the weighted average
    assert not np.allclose(
        normalized_average(x, ys, weights, [1.0, 10.0, 3.0])["w"], weighted_average(ys, weights)["w"]
    )


def local_gd(x: float, target: float, steps: int, lr: float) -> float:
    for _ in range(steps):
        x -= lr * (x - target)  # f_i(x) = (x - e_i)^2 / 2
    return x


def test_paper_direction_on_quadratics() -> None:
    """Two clients, f_i(x) = (x - e_i)^2 / 2, e = (0, 1), equal weights, 2 and 20 local GD steps at
    lr 0.01: the kind of quadratic example the paper uses to show objective inconsistency. After tau
    steps x - y_i = (1 - (1 - lr)^tau)(x - e_i), so FedAvg settles at the mean of e_i weighted by
    1 - (1 - lr)^tau_i, near tau_i / sum tau (the surrogate objective that over-weights the client
    with more steps: 20/22), FedNova at the mean weighted by that over tau_i, near the true minimiser
    1/2 (exactly as lr -> 0)."""
    targets, steps, lr = (0.0, 1.0), (2, 20), 0.01
    fedavg = fednova = 5.0
    for _ in range(3000):
        ys = [local_gd(fedavg, e, k, lr) for e, k in zip(targets, steps, strict=True)]
        fedavg = float(weighted_average([{"x": np.array(y)} for y in ys], [1, 1])["x"])
        ys = [{"x": np.array(local_gd(fednova, e, k, lr))} for e, k in zip(targets, steps, strict=True)]
        fednova = float(normalized_average({"x": np.array(fednova)}, ys, [1, 1], [float(k) for k in steps])["x"])
    w = [1 - (1 - lr) ** k for k in steps]
    assert fedavg == pytest.approx(w[1] / sum(w), abs=1e-9) and fedavg > 0.9
    v = [wi / k for wi, k in zip(w, steps, strict=True)]
    assert fednova == pytest.approx(v[1] / sum(v), abs=1e-9) and abs(fednova - 0.5) < 0.025


def reply(arrays: dict, partition: int, num_examples: int, **metrics) -> Message:
    m = MetricRecord({"num-examples": num_examples, "partition-id": partition, **metrics})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": m}), dst_node_id=1, message_type="train")


def test_server_counts_the_steps_itself_and_matches_fedavg_on_equal_partitions(task_identity) -> None:
    """Equal iid partitions: FedNova's aggregate is FedAvg's. Unequal (Dirichlet) partitions: they
    differ, and a reply's own `train-steps` changes nothing."""
    for partition, same in (("iid", True), ("dirichlet", False)):
        cfg = validate({"method": "fednova", "model": "mlp", "partition": partition, "dirichlet-alpha": 0.3})
        nova, avg = FedNovaStrategy(cfg), FedAvgStrategy(cfg)
        for s in (nova, avg):
            s.num_partitions = 10
            s.sent_arrays = s.initial_arrays()
        x = nova.sent_arrays.to_torch_state_dict()
        g = torch.Generator().manual_seed(0)
        ys = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in x.items()} for _ in range(3)]
        replies = [reply(y, p, 100) for p, y in zip((0, 4, 7), ys, strict=True)]
        a, b = nova.aggregate_arrays(1, replies), avg.aggregate_arrays(1, replies)
        close = all(np.allclose(a[k].numpy(), b[k].numpy(), atol=1e-6) for k in x)
        assert close == same, partition
        lying = [reply(y, p, 100, **{"train-steps": 1.0}) for p, y in zip((0, 4, 7), ys, strict=True)]
        c = nova.aggregate_arrays(1, lying)
        assert all(np.array_equal(a[k].numpy(), c[k].numpy()) for k in x)
        assert nova.aggregate_extras(1, replies)["tau-eff"] > 1


def test_in_process_runs_equal_fedavg_on_equal_partitions(tmp_path, task_identity) -> None:
    cfg = {"model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 2, "out-dir": str(tmp_path)}
    run_in_process({**cfg, "method": "fednova", "run-name": "nova"}, 4, None, 50)
    run_in_process({**cfg, "method": "fedavg", "run-name": "avg"}, 4, None, 50)
    nova = [json.loads(line) for line in (tmp_path / "nova" / "metrics.jsonl").read_text().splitlines()]
    avg = [json.loads(line) for line in (tmp_path / "avg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["global-accuracy"] for r in nova] == pytest.approx([r["global-accuracy"] for r in avg], abs=2e-3)
    assert nova[-1]["tau-eff"] > 1
