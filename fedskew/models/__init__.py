"""The papers' small networks, each split into `features` (x -> h in R^d) and a bias-free
`classifier` (h -> W h, W in R^{C x d}), as FedRS, MAP and FedGELA use.

- `lenet`  : LeNet-5 (conv 6-16, fc 120-84), d = 84           (FedRS Fig. 3 style, FMNIST); also Flower
             niid_bench's Fashion-MNIST `CNNMnist` (44,426 parameters there, 10 fewer here)
- `map-lenet`: the MAP/FedRS authors' FMNIST LeNet (`lxcnju/FedRepo`): conv5x5 1-16, pool, conv5x5
             16-16, pool, no hidden FC layer, d = 16 * 4 * 4 = 256
- `mupfl-cnn`: MuPFL's FMNIST CNN, "two 5x5 conv layers followed by a single linear layer"; channels
             unspecified, our choice: conv 1-32, pool, conv 32-64, pool, d = 64 * 4 * 4 = 1024
- `pfl-cnn`: pfl-research's CIFAR-10 benchmark CNN (`apple/pfl-research`, benchmarks/model/pytorch/cnn.py,
             `simple_cnn`): conv3x3 -32, conv3x3 32-64, pool, FC 128, d = 128; without its two dropout
             layers (no fedskew model draws random numbers in training, which the batched engine relies on)
             and with PyTorch's default initialisation instead of its Glorot one
- `pfllib-cnn`: PFLlib's "4-layer CNN" (`TsingZ0/PFLlib`, system/flcore/trainmodel/models.py,
             `FedAvgCNN`, the network of its Fashion-MNIST leaderboard): conv5x5 1-32, pool, conv5x5
             32-64, pool, FC 1024-512, d = 512 (582,026 parameters there, 10 fewer here: the bias-free
             classifier)
- `mlp`    : 2 x 200 hidden units, d = 200                     (FedAvg's MNIST MLP)
- `tfcnn`  : conv 32-64-64, padding 1, three max-pools, d = 64 * (s/8)^2  (FedRS Table 4)
- `vgg11`  : VGG-11 without BN, d = 512; inputs below 32x32 are zero-padded to 32 (FedRS Table 5)
- `resnet8`, `resnet18`: CIFAR ResNets (BasicBlock, BN), d = 64 / 512 (FedGELA, FedMR, MuPFL)

Initialisation is PyTorch's default. Deviation: none of the classifiers has a bias (FedRS leaves it out
and its code's classifier has none; the restricted softmax then scales the whole logit), unless
`bias=True` (the run key `classifier-bias`, for the methods that treat the classifier as any other
layer: a peer's network that has one, as niid_bench's `CNNMnist`).
Methods that split a network into a shared body and a head (FedRep, FedBABU, FedRoD) use `features`
(state-dict names under `BODY`) as the body and `classifier` as the head.

Input sizes (`check_input`): the two-conv nets (`lenet`, `map-lenet`, `mupfl-cnn`, `pfllib-cnn`) need
images of at least 16 x 16 (two 5x5 convolutions and two 2x2 pools leave one pixel), `pfl-cnn` at
least 6 x 6 (two 3x3 convolutions and a pool), `tfcnn` at least 8 x 8 (three pools); the others take
any size. Every model takes at most `fedskew.data.MAX_IMAGE_SIZE` (256) pixels a side, since the
flattening nets' first layers grow with the image's area (3000-pixel images would give LeNet some
1.8e9 parameters), and 1 or 3 channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.data import MAX_IMAGE_SIZE, dataset_info
from fedskew.schema import ConfigError

if TYPE_CHECKING:
    from fedskew.data import DatasetInfo


BODY = "features."


class SplitNet(nn.Module):
    """`features` then a linear `classifier`, bias-free unless `build_model(..., bias=True)` gave it
    one; `forward(x) = classifier(features(x))`."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.classifier = nn.Linear(feature_dim, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def class_weights(self) -> torch.Tensor:
        """`[C, d]`: row c is class c's classifier vector w_c (logit z_c = w_c^T h)."""
        return self.classifier.weight


def _flat_dim(body: nn.Module, channels: int, size: int) -> int:
    with torch.no_grad():
        return int(body(torch.zeros(1, channels, size, size)).flatten(1).shape[1])


def lenet(channels: int, size: int, num_classes: int) -> SplitNet:
    conv = nn.Sequential(
        nn.Conv2d(channels, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    flat = _flat_dim(conv, channels, size)
    features = nn.Sequential(conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return SplitNet(features, 84, num_classes)


def _two_conv(channels: int, size: int, num_classes: int, widths: tuple[int, int]) -> SplitNet:
    """conv5x5 - ReLU - pool - conv5x5 - ReLU - pool - flatten, then the linear classifier only."""
    features = nn.Sequential(
        nn.Conv2d(channels, widths[0], 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return SplitNet(features, _flat_dim(features, channels, size), num_classes)


def map_lenet(channels: int, size: int, num_classes: int) -> SplitNet:
    return _two_conv(channels, size, num_classes, (16, 16))


def mupfl_cnn(channels: int, size: int, num_classes: int) -> SplitNet:
    return _two_conv(channels, size, num_classes, (32, 64))


def pfllib_cnn(channels: int, size: int, num_classes: int) -> SplitNet:
    conv = nn.Sequential(
        nn.Conv2d(channels, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    features = nn.Sequential(conv, nn.Linear(_flat_dim(conv, channels, size), 512), nn.ReLU())
    return SplitNet(features, 512, num_classes)


def pfl_cnn(channels: int, size: int, num_classes: int) -> SplitNet:
    conv = nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    features = nn.Sequential(conv, nn.Linear(_flat_dim(conv, channels, size), 128), nn.ReLU())
    return SplitNet(features, 128, num_classes)


def mlp(channels: int, size: int, num_classes: int) -> SplitNet:
    features = nn.Sequential(
        nn.Flatten(), nn.Linear(channels * size * size, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU()
    )
    return SplitNet(features, 200, num_classes)


def tfcnn(channels: int, size: int, num_classes: int) -> SplitNet:
    features = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return SplitNet(features, _flat_dim(features, channels, size), num_classes)


class _PadTo(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gap = self.size - x.shape[-1]
        if gap <= 0:
            return x
        return F.pad(x, (gap // 2, gap - gap // 2, gap // 2, gap - gap // 2))


def vgg11(channels: int, size: int, num_classes: int) -> SplitNet:
    layers: list[nn.Module] = [_PadTo(32)]
    c_in = channels
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c_in, int(v), 3, padding=1), nn.ReLU()]
            c_in = int(v)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return SplitNet(nn.Sequential(*layers), 512, num_classes)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet(channels: int, widths: tuple[int, ...], blocks: int, num_classes: int) -> SplitNet:
    layers: list[nn.Module] = [
        nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(),
    ]
    c_in = widths[0]
    for i, w in enumerate(widths):
        for b in range(blocks):
            layers.append(BasicBlock(c_in, w, 2 if (i > 0 and b == 0) else 1))
            c_in = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return SplitNet(nn.Sequential(*layers), c_in, num_classes)


def resnet8(channels: int, size: int, num_classes: int) -> SplitNet:
    return _resnet(channels, (16, 32, 64), 1, num_classes)


def resnet18(channels: int, size: int, num_classes: int) -> SplitNet:
    return _resnet(channels, (64, 128, 256, 512), 2, num_classes)


MODELS: dict[str, Callable[[int, int, int], SplitNet]] = {
    "lenet": lenet,
    "map-lenet": map_lenet,
    "mupfl-cnn": mupfl_cnn,
    "pfl-cnn": pfl_cnn,
    "pfllib-cnn": pfllib_cnn,
    "mlp": mlp,
    "tfcnn": tfcnn,
    "vgg11": vgg11,
    "resnet8": resnet8,
    "resnet18": resnet18,
}


MIN_SIZE: dict[str, int] = {
    "lenet": 16,
    "map-lenet": 16,
    "mupfl-cnn": 16,
    "pfllib-cnn": 16,
    "pfl-cnn": 6,
    "tfcnn": 8,
}  # others: 1


def check_input(name: str, info: DatasetInfo) -> None:
    """Raise ConfigError (one line) unless model `name` takes the data set's images (see above)."""
    low = MIN_SIZE.get(name, 1)
    if not low <= info.size <= MAX_IMAGE_SIZE or info.channels not in (1, 3):
        raise ConfigError(
            f"model={name!r} takes images of {low} to {MAX_IMAGE_SIZE} pixels a side with 1 or 3 channels; "
            f"the data set's are {info.size}x{info.size} with {info.channels} (hf: data sets: set hf-image-size)"
        )


def build_model(name: str, dataset: str | DatasetInfo, bias: bool = False) -> SplitNet:
    """A fresh `name` network shaped for `dataset` (channels, image size, classes): the data set's
    `DatasetInfo` (`fedskew.data.dataset_info(cfg)`), or the name of a standard set. `bias` gives the
    classifier a bias, drawn after everything else, so the other parameters are those of `bias=False`."""
    info = dataset_info(dataset) if isinstance(dataset, str) else dataset
    check_input(name, info)
    net = MODELS[name](info.channels, info.size, info.num_classes)
    if bias:
        bound = 1.0 / net.feature_dim**0.5  # nn.Linear's default bias draw, U(-1/sqrt(d), 1/sqrt(d))
        net.classifier.bias = nn.Parameter(torch.empty(net.num_classes).uniform_(-bound, bound))
    return net


def run_model(cfg: dict[str, Any]) -> SplitNet:
    """A fresh network of the validated run config `cfg` (its model, data set and classifier bias)."""
    return build_model(cfg["model"], dataset_info(cfg), cfg["classifier-bias"])


def initial_model(name: str, dataset: str | DatasetInfo, seed: int, bias: bool = False) -> SplitNet:
    """The run's initial global model w^0: `build_model` right after `torch.manual_seed(seed)`, the
    draw of the server's initial arrays (`BaseStrategy.initial_arrays`), made inside
    `torch.random.fork_rng` so that the caller's random stream continues as if it had not been called.
    A client whose method starts a personal part from w^0 draws it here, with nothing sent."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(name, dataset, bias)


def body_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The body's entries (`BODY`) of a network's state dict, in order."""
    return {k: v for k, v in state.items() if k.startswith(BODY)}
