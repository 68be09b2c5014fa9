"""The peers' Fashion-MNIST networks (docs/notes/peers.md) against their own definitions.

- Flower baselines' niid_bench (`adap/flower`, baselines/niid_bench/niid_bench/models.py at 50a719ac,
  `CNNMnist`, chosen by main.py whenever the data set's name contains "mnist"): conv5x5 1-6, pool,
  conv5x5 6-16, pool, fc 256-120-84-10, with biases: fedskew's `lenet`.
- PFLlib (`TsingZ0/PFLlib`, system/flcore/trainmodel/models.py at 487a29ea, `FedAvgCNN(in_features=1,
  dim=1024)`): conv5x5 1-32, pool, conv5x5 32-64, pool, fc 1024-512, fc 512-10: `pfllib-cnn`.

Each peer's network is rebuilt here layer for layer from its code; fedskew's differs in one detail
only, its classifier's missing bias (every fedskew network is a `SplitNet` with a bias-free linear
classifier), so it has `num_classes` = 10 parameters fewer and the same shapes everywhere else. With
the run key `classifier-bias` it is the peer's network; with `input-scaling` 'unit' its inputs are
niid_bench's (torchvision's `ToTensor` alone: x / 255).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.config import validate
from fedskew.data import dataset_info
from fedskew.data.clients import to_float
from fedskew.models import build_model, initial_model, run_model


def niid_bench_cnn_mnist() -> nn.Module:
    """niid_bench's `CNNMnist(input_dim=256, hidden_dims=[120, 84], num_classes=10)`."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2, 2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2, 2),
        nn.Flatten(),
        nn.Linear(256, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


def pfllib_fedavg_cnn() -> nn.Module:
    """PFLlib's `FedAvgCNN(in_features=1, num_classes=10, dim=1024)`."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1024, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("name", "peer", "peer_params", "dim"),
    [("lenet", niid_bench_cnn_mnist, 44_426, 84), ("pfllib-cnn", pfllib_fedavg_cnn, 582_026, 512)],
)
def test_a_peers_network_is_its_definition_without_the_classifier_bias(name, peer, peer_params, dim) -> None:
    ours, theirs = build_model(name, "fashion-mnist"), peer()
    assert n_params(theirs) == peer_params
    assert n_params(ours) == peer_params - 10 and ours.feature_dim == dim
    # the same weight shapes in the same order; the peer's last bias is the one fedskew leaves out
    shapes = [tuple(p.shape) for p in ours.parameters()]
    assert shapes == [tuple(p.shape) for p in theirs.parameters()][:-1]
    assert ours.classifier.bias is None and tuple(ours.classifier.weight.shape) == (10, dim)
    x = torch.randn(3, 1, 28, 28)
    assert ours.features(x).shape == (3, dim) and ours(x).shape == (3, 10)


@pytest.mark.parametrize(("name", "peer"), [("lenet", niid_bench_cnn_mnist), ("pfllib-cnn", pfllib_fedavg_cnn)])
def test_with_the_peers_weights_and_a_zero_bias_ours_computes_the_peers_logits(name, peer) -> None:
    """Copying the peer's weights in order (its classifier bias set to 0) gives the same function:
    the layers, activations and pools are the peer's, not only their shapes."""
    torch.manual_seed(0)
    ours, theirs = build_model(name, "fashion-mnist"), peer()
    theirs[-1].bias.data.zero_()
    with torch.no_grad():
        for mine, their in zip(ours.parameters(), theirs.parameters(), strict=False):
            mine.copy_(their)
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize(("name", "peer"), [("lenet", niid_bench_cnn_mnist), ("pfllib-cnn", pfllib_fedavg_cnn)])
def test_with_a_classifier_bias_ours_is_the_peers_network(name, peer) -> None:
    """`classifier-bias`: the peer's parameters, shapes and order, and with its weights copied, its
    logits (compared in float64: the same operations in the same order)."""
    ours = run_model(validate({"model": name, "classifier-bias": True}))
    theirs = peer().double()
    assert [tuple(p.shape) for p in ours.parameters()] == [tuple(p.shape) for p in theirs.parameters()]
    ours = ours.double()
    with torch.no_grad():
        for mine, their in zip(ours.parameters(), theirs.parameters(), strict=True):
            mine.copy_(their)
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_a_classifier_bias_leaves_the_seeded_draw_of_every_other_parameter() -> None:
    """The bias is drawn after the rest (nn.Linear's U(-1/sqrt(d), 1/sqrt(d))), so a run with it starts
    from the same weights as the run without it, under the same seed."""
    plain = initial_model("lenet", "fashion-mnist", 3)
    biased = initial_model("lenet", "fashion-mnist", 3, bias=True)
    b = biased.state_dict()
    assert list(b) == [*plain.state_dict(), "classifier.bias"]
    for k, v in plain.state_dict().items():
        assert torch.equal(v, b[k]), k
    bound = 1 / 84**0.5
    assert float(b["classifier.bias"].abs().max()) <= bound and float(b["classifier.bias"].std()) > bound / 10
    assert not torch.equal(b["classifier.bias"], initial_model("lenet", "fashion-mnist", 4, bias=True).classifier.bias)


def test_unit_input_scaling_is_to_tensor_and_the_default_standardises() -> None:
    x = np.array([[[[0, 51, 255]]]], dtype=np.uint8)
    unit = to_float(x, dataset_info(validate({"input-scaling": "unit"})))
    torch.testing.assert_close(unit, torch.tensor([[[[0.0, 0.2, 1.0]]]]), rtol=0, atol=0)
    info = dataset_info(validate({}))
    standard = to_float(x, info)
    torch.testing.assert_close(standard, (unit - info.mean[0]) / info.std[0])
