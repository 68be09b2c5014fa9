"""FedAwS: the spreadout regularizer against a hand computation, the server step (close class
embeddings move apart, far ones stay), the FedRS authors' FedAwS step, the strategy, and a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Message, MetricRecord, RecordDict

from fedskew.config import validate
from fedskew.losses.fedaws import pairwise_distances, spreadout, spreadout_regularizer
from fedskew.strategies.base import numpy_to_arrays
from fedskew.strategies.fedavg import FedAvgStrategy
from fedskew.strategies.fedaws import FedAwSStrategy
from tests.harness import FLOAT64, run_in_process


def test_regularizer_matches_a_hand_computation() -> None:
    w = torch.tensor([[0.0, 0.0], [0.3, 0.4], [3.0, 4.0]])  # distances 0.5, 5, 4.5
    assert spreadout_regularizer(w, 1.0, "euclidean").item() == pytest.approx(2 * (1.0 - 0.5) ** 2)
    u = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)  # (1 - cos) / 2: 0.5, 0.1464, 0.1464
    gap = 0.5 - 0.5 * (1 - 2**-0.5)
    assert spreadout_regularizer(u, 0.5, "cosine").item() == pytest.approx(4 * gap**2, rel=1e-12)  # float64
    with pytest.raises(ValueError):
        spreadout_regularizer(u, 0.5, "manhattan")


@pytest.mark.parametrize(
    ("distance", "w", "margin"),
    [
        ("euclidean", [[1.0, 0.0], [1.1, 0.0], [10.0, 10.0]], 1.0),
        # margin 0.3 (66 degrees): the close pair spreads to about +-33 degrees and stays beyond the margin
        # of the far one; at 0.8 (127 degrees) three 2-D embeddings end 120 degrees apart, all inside it
        ("cosine", [[1.0, 0.05], [1.0, -0.05], [-1.0, 0.0]], 0.3),
    ],
)
def test_the_server_step_spreads_close_embeddings_and_leaves_far_ones_alone(distance, w, margin) -> None:
    w = torch.tensor(w)

    def d(v: torch.Tensor, i: int = 0, j: int = 1) -> float:  # the distance of a pair (the close one)
        return pairwise_distances(v, distance)[i, j].item()

    new = spreadout(w, margin, distance, steps=200, lr=0.05)
    assert d(w) < margin / 5 and d(new) > 0.9 * margin  # the close pair is pushed to the margin
    # the far embedding's pairs stay beyond the margin at every step (the close pair turns away from each
    # other, towards the far one, so its nearest approach is the end), so its gradient is exactly 0 (the
    # hinge's, a sum of exact zeros on any CPU): untouched, bit for bit
    assert min(d(v, i, 2) for v in (w, new) for i in (0, 1)) > margin
    assert torch.equal(new[2], w[2])
    assert spreadout_regularizer(new, margin, distance) < spreadout_regularizer(w, margin, distance) / 50
    assert torch.equal(spreadout(w, margin, distance, steps=0, lr=0.05), w)


def test_the_cosine_step_is_the_fedrs_authors_fedaws() -> None:
    """Derived from lxcnju/FedRepo at 617ee015 (`algorithms/fedaws.py`: `SpreadModel` and
    `update_global_classifier`): the mean over the C x C matrix of ((margin - d) * [margin > d])^2,
    d = (1 - cos) / 2 with the diagonal set to 0, SGD with momentum 0.9 for `aws_steps` steps. On the
    sum over pairs here, the same steps take lr aws_lr / C^2."""
    g = torch.Generator().manual_seed(0)
    ws0 = torch.randn(10, 16, generator=g, dtype=torch.float64)  # a mean and a sum over pairs: compared in float64
    margin, aws_lr, aws_steps = 0.8, 0.1, 30
    ws = torch.nn.Parameter(ws0.clone())
    opt = torch.optim.SGD([ws], lr=aws_lr, momentum=0.9)
    for _ in range(aws_steps):
        ws_norm = F.normalize(ws, dim=1)
        cos_dis = 0.5 * (1.0 - ws_norm @ ws_norm.T) * (1.0 - torch.eye(10))
        indx = ((margin - cos_dis) > 0.0).float()
        loss = (((margin - cos_dis) * indx) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = spreadout(ws0, margin, "cosine", aws_steps, aws_lr / 10**2, momentum=0.9)
    assert torch.allclose(got, ws.detach(), **FLOAT64)
    assert (got - ws0).abs().max() > 1e-3


def client_reply(strategy, pid: int, scale: float) -> Message:
    arrays = {k: v.numpy() * scale for k, v in strategy.sent_arrays.items()}
    out = Message(RecordDict(), dst_node_id=10 + pid, message_type="train")
    metrics = MetricRecord({"num-examples": 100 * (pid + 1), "partition-id": pid, "train-seconds": 1.0})
    return Message(RecordDict({"arrays": numpy_to_arrays(arrays), "metrics": metrics}), reply_to=out)


@pytest.mark.parametrize("steps", [0, 30])
def test_the_strategy_spreads_the_aggregated_classifier_only(task_identity, steps: int) -> None:
    cfg = validate({"method": "fedaws", "model": "mlp", "partition": "iid", "fedaws-steps": steps, "fedaws-lr": 0.01})
    aws, avg = FedAwSStrategy(cfg), FedAvgStrategy(cfg)
    for s in (aws, avg):
        s.sent_arrays = s.initial_arrays()
        s.num_partitions = 2
        s.node_partitions = {10: 0, 11: 1}
    got, metrics = aws.aggregate_train(1, [client_reply(aws, 0, 1.0), client_reply(aws, 1, 0.5)])
    want, _ = avg.aggregate_train(1, [client_reply(avg, 0, 1.0), client_reply(avg, 1, 0.5)])
    for k in want.keys():
        same = np.array_equal(got[k].numpy(), want[k].numpy())
        assert same == (k != "classifier.weight" or steps == 0), k
    w = torch.from_numpy(want["classifier.weight"].numpy())
    expect = spreadout(w, 0.8, "cosine", steps, 0.01, 0.9)
    assert torch.allclose(torch.from_numpy(got["classifier.weight"].numpy()), expect)
    assert metrics["spreadout-after"] <= metrics["spreadout-before"]


def test_fedaws_runs_in_process(tmp_path, task_identity) -> None:
    cfg = {"method": "fedaws", "model": "mlp", "num-server-rounds": 2, "fraction-train": 1.0}
    run_in_process({**cfg, "out-dir": str(tmp_path), "run-name": "fedaws"}, 4, num_partitions=50)
    rows = [json.loads(line) for line in (tmp_path / "fedaws" / "metrics.jsonl").read_text().splitlines()]
    assert [r["replies"] for r in rows] == [4, 4] and all(r["failures"] == 0 for r in rows)
    assert all(r["spreadout-after"] < r["spreadout-before"] for r in rows)
