"""Training augmentation: shapes, determinism under the seed, and what crop and flip do to pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedskew.config import validate
from fedskew.data import DATASET_INFO, dataset_info
from fedskew.data.augment import Augmentation, augmentation
from fedskew.data.clients import to_float
from fedskew.models import build_model
from fedskew.training import cross_entropy_loss, train_epochs

FILL = (-1.0, -2.0, -3.0)


def batch(n: int = 64, c: int = 3, size: int = 8) -> torch.Tensor:
    return torch.rand(n, c, size, size, generator=torch.Generator().manual_seed(1))


def windows(x: torch.Tensor, pad: int) -> list[torch.Tensor]:
    """Every crop of `x` [C, H, W] padded by `pad` with FILL, by brute force."""
    c, h, w = x.shape
    padded = torch.tensor(FILL[:c]).view(c, 1, 1).repeat(1, h + 2 * pad, w + 2 * pad)
    padded[:, pad : pad + h, pad : pad + w] = x
    return [padded[:, i : i + h, j : j + w] for i in range(2 * pad + 1) for j in range(2 * pad + 1)]


def test_shapes_dtype_and_determinism_under_the_seed() -> None:
    aug, x = Augmentation(4, True, FILL), batch(size=32)
    a = aug(x, torch.Generator().manual_seed(7))
    b = aug(x, torch.Generator().manual_seed(7))
    c = aug(x, torch.Generator().manual_seed(8))
    assert a.shape == x.shape and a.dtype == x.dtype and a.is_contiguous()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_flip_alone_mirrors_about_half_the_images() -> None:
    x = batch()
    out = Augmentation(0, True, FILL)(x, torch.Generator().manual_seed(0))
    same = [torch.equal(o, i) for o, i in zip(out, x, strict=True)]
    mirrored = [torch.equal(o, i.flip(-1)) for o, i in zip(out, x, strict=True)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))
    assert 16 < sum(mirrored) < 48  # Binomial(64, 1/2)


def test_crop_is_a_window_of_the_padded_image_and_keeps_the_pixels() -> None:
    x, pad = batch(n=32), 2
    out = Augmentation(pad, False, FILL)(x, torch.Generator().manual_seed(0))
    offsets = []
    for o, i in zip(out, x, strict=True):
        hits = [k for k, win in enumerate(windows(i, pad)) if torch.equal(o, win)]
        assert hits, "an output is not a crop of its padded input"
        offsets.append(hits[0])
    assert len(set(offsets)) > 5  # offsets are random, not one shift for the batch
    # the padding is the fill value: a shifted image shows FILL in the uncovered border
    assert set(torch.unique(out[:, 0]).tolist()) - set(torch.unique(x[:, 0]).tolist()) <= {FILL[0]}


def test_crop_and_flip_is_a_mirrored_or_plain_window() -> None:
    x, pad = batch(n=32, c=1), 1
    out = Augmentation(pad, True, FILL[:1])(x, torch.Generator().manual_seed(3))
    for o, i in zip(out, x, strict=True):
        wins = windows(i, pad)
        assert any(torch.equal(o, win) or torch.equal(o, win.flip(-1)) for win in wins)


def test_auto_follows_the_papers_and_fill_is_a_black_pixel() -> None:
    def aug(**kw):
        cfg = validate(kw)
        return augmentation(cfg, dataset_info(cfg) if not cfg["dataset"].startswith("hf:") else DATASET_INFO["svhn"])

    cifar = aug(dataset="cifar10")
    assert cifar == Augmentation(4, True, cifar.fill)
    black = to_float(np.zeros((1, 3, 1, 1), dtype=np.uint8), "cifar10").flatten().tolist()
    assert cifar.fill == pytest.approx(black)
    assert aug(dataset="cifar100").flip and aug(dataset="svhn") == Augmentation(4, False, aug(dataset="svhn").fill)
    assert aug(dataset="mnist") is None and aug(dataset="fashion-mnist") is None
    assert aug(dataset="hf:some/repo") is None and aug(dataset="hf:some/repo", augment="crop-flip").flip
    assert aug(dataset="cifar10", augment="none") is None
    assert aug(dataset="mnist", augment="crop").pad == 4  # 28 / 8 rounds to 4 (3.5 -> 4)


def test_training_with_augmentation_is_reproducible_and_changes_the_result() -> None:
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))
    aug = augmentation(validate({"dataset": "cifar10"}), DATASET_INFO["cifar10"])

    def train(augment) -> torch.Tensor:
        torch.manual_seed(0)
        model = build_model("lenet", "cifar10")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        train_epochs(
            model, x, y, cross_entropy_loss, opt, 1, 32, torch.Generator().manual_seed(5), torch.device("cpu"), augment
        )
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    first = train(aug)
    assert torch.equal(first, train(aug))
    assert not torch.equal(first, train(None))
