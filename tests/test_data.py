"""Readers for the standard files, tested on small files written here in the real formats."""

from __future__ import annotations

import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.data import DATASET_INFO, DataMissingError
from fedskew.data.clients import load_client_data, to_float
from fedskew.data.readers import load_dataset, read_cifar_batch, read_idx
from tests.conftest import write_idx

RNG = np.random.default_rng(0)


def write_mnist(folder: Path, n_train: int = 50, n_test: int = 20, gz: bool = True) -> tuple[np.ndarray, ...]:
    folder.mkdir(parents=True)
    arrays = (
        RNG.integers(0, 256, (n_train, 28, 28)),
        RNG.integers(0, 10, n_train),
        RNG.integers(0, 256, (n_test, 28, 28)),
        RNG.integers(0, 10, n_test),
    )
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    for name, a in zip(names, arrays, strict=True):
        write_idx(folder / name, a, gz)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_round_trips(tmp_path: Path, gz: bool) -> None:
    xtr, ytr, xte, yte = write_mnist(tmp_path / "mnist", gz=gz)
    load_dataset.cache_clear()
    x, y, x2, y2 = load_dataset("mnist", str(tmp_path))
    assert x.shape == (50, 1, 28, 28) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.array_equal(x[:, 0], xtr) and np.array_equal(y, ytr)
    assert np.array_equal(x2[:, 0], xte) and np.array_equal(y2, yte)


def test_torchvision_layout_is_found(tmp_path: Path) -> None:
    write_mnist(tmp_path / "FashionMNIST" / "raw", gz=False)
    load_dataset.cache_clear()
    assert load_dataset("fashion-mnist", str(tmp_path))[0].shape[0] == 50


def test_idx_reader_rejects_wrong_sizes(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 5)
    with pytest.raises(ValueError, match="expected 10"):
        read_idx(bad)


def _cifar_batch(path: Path, n: int, label_key: bytes) -> tuple[np.ndarray, list[int]]:
    data = RNG.integers(0, 256, (n, 3072)).astype(np.uint8)
    labels = RNG.integers(0, 10, n).tolist()
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"x", b"data": data, label_key: labels}, f, protocol=2)
    return data, labels


def test_cifar10_and_100_readers(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = [_cifar_batch(folder / f"data_batch_{i}", 4, b"labels") for i in range(1, 6)]
    test = _cifar_batch(folder / "test_batch", 3, b"labels")
    load_dataset.cache_clear()
    x, y, x2, y2 = load_dataset("cifar10", str(tmp_path))
    assert x.shape == (20, 3, 32, 32) and x2.shape == (3, 3, 32, 32)
    assert np.array_equal(x[0].reshape(-1), batches[0][0][0]) and y.tolist()[:4] == batches[0][1]
    assert y2.tolist() == test[1]
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _cifar_batch(folder / "train", 6, b"fine_labels")
    _cifar_batch(folder / "test", 2, b"fine_labels")
    assert load_dataset("cifar100", str(tmp_path))[0].shape == (6, 3, 32, 32)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_cifar_unpickler_refuses_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": [1]}, f)
    with pytest.raises(ValueError, match="refusing"):
        read_cifar_batch(path, b"labels")


def test_svhn_reader(tmp_path: Path) -> None:
    from scipy.io import savemat

    folder = tmp_path / "svhn"
    folder.mkdir()
    for name, n in (("train", 5), ("test", 3)):
        x = RNG.integers(0, 256, (32, 32, 3, n)).astype(np.uint8)
        y = np.array([[10], [1], [2], [3], [4]][:n], dtype=np.uint8)
        savemat(folder / f"{name}_32x32.mat", {"X": x, "y": y})
    load_dataset.cache_clear()
    x, y, _x2, y2 = load_dataset("svhn", str(tmp_path))
    assert x.shape == (5, 3, 32, 32) and y.tolist() == [0, 1, 2, 3, 4]  # label 10 is digit 0
    assert y2.tolist() == [0, 1, 2]


@pytest.mark.parametrize("name", ["mnist", "cifar10", "cifar100", "svhn"])
def test_missing_data_says_what_to_put_where(tmp_path: Path, name: str) -> None:
    load_dataset.cache_clear()
    with pytest.raises(DataMissingError, match=str(tmp_path)):
        load_dataset(name, str(tmp_path))


def test_debian_fashion_mnist_hint(tmp_path: Path, monkeypatch) -> None:
    from fedskew.data import readers

    monkeypatch.setattr(readers, "DEBIAN_FMNIST", tmp_path / "nowhere")
    load_dataset.cache_clear()
    with pytest.raises(DataMissingError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", str(tmp_path))
    load_dataset.cache_clear()


def test_normalisation_and_client_split(tmp_path: Path) -> None:
    write_mnist(tmp_path / "mnist", n_train=200)
    load_dataset.cache_clear()
    from fedskew.config import validate

    cfg = validate({"dataset": "mnist", "data-root": str(tmp_path), "partition": "iid", "min-partition-size": 1})
    d = load_client_data(cfg, 1, 4)
    assert len(d.y_train) + len(d.y_test) == 50 and d.x_train.dtype == torch.float32
    x = np.full((1, 1, 2, 2), 255, dtype=np.uint8)
    info = DATASET_INFO["mnist"]
    assert torch.allclose(to_float(x, "mnist"), torch.full((1, 1, 2, 2), (1 - info.mean[0]) / info.std[0]))
    with pytest.raises(ValueError, match="partition-id"):
        load_client_data(cfg, 4, 4)
    load_dataset.cache_clear()


def test_partition_seed_fixes_the_split_across_seeds(tmp_path: Path) -> None:
    """`partition-seed` -1 splits by the run's seed (as before the key); a fixed one gives every seed
    the same partition and local test splits, which are then those of a run whose seed it is."""
    write_mnist(tmp_path / "mnist", n_train=400)
    load_dataset.cache_clear()
    from fedskew.config import validate
    from fedskew.data.clients import client_indices, partition_key

    base = {"dataset": "mnist", "data-root": str(tmp_path), "partition": "dirichlet", "min-partition-size": 1}
    base["local-test-fraction"] = 0.2

    def split(**keys: int) -> list[tuple[list[int], list[int]]]:
        return [(tr.tolist(), te.tolist()) for tr, te in client_indices(validate({**base, **keys}), 4)]

    assert split(seed=1) == split(seed=1, **{"partition-seed": -1}) != split(seed=2)
    assert split(seed=1, **{"partition-seed": 42}) == split(seed=2, **{"partition-seed": 42}) == split(seed=42)
    # one key, so one cached split (and one node cache file) for every run that splits alike
    keys = {partition_key(validate({**base, "seed": s, "partition-seed": 42})) for s in (1, 2)}
    assert keys == {partition_key(validate({**base, "seed": 42}))}
    load_dataset.cache_clear()


def test_real_fashion_mnist_is_complete() -> None:
    x, y, x2, y2 = load_dataset("fashion-mnist", "")
    assert x.shape == (60000, 1, 28, 28) and x2.shape == (10000, 1, 28, 28)
    assert (np.bincount(y) == 6000).all() and (np.bincount(y2) == 1000).all()


# ---------------------------------------------------------------------- damaged files are refused
def _mnist_with(tmp_path: Path, n_images: int, labels: np.ndarray) -> Path:
    folder = tmp_path / "mnist"
    write_mnist(folder)
    write_idx(folder / "train-images-idx3-ubyte", RNG.integers(0, 256, (n_images, 28, 28)), gz=True)
    write_idx(folder / "train-labels-idx1-ubyte", labels, gz=True)
    return tmp_path


def _cifar_with(tmp_path: Path, data: np.ndarray, labels: list[int]) -> Path:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        _cifar_batch(folder / f"data_batch_{i}", 4, b"labels")
    _cifar_batch(folder / "test_batch", 3, b"labels")
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": data, b"labels": labels}, f, protocol=2)
    return tmp_path


@pytest.mark.parametrize(
    ("make", "name", "needle"),
    [
        (lambda p: _mnist_with(p, 10, np.arange(7)), "mnist", "10 images but 7 labels"),
        (lambda p: _mnist_with(p, 10, np.full(10, 77)), "mnist", "labels in [77, 77]"),
        (lambda p: _cifar_with(p, np.zeros((10, 3072), np.uint8), [1] * 7), "cifar10", "images but"),
        (lambda p: _cifar_with(p, np.zeros((4, 3072), np.uint8), [1, 2, 3, 10]), "cifar10", "labels"),
        (lambda p: _cifar_with(p, np.zeros(3000, np.uint8), [1]), "cifar10", "not a CIFAR batch"),
    ],
    ids=["idx-misaligned", "idx-label-77", "cifar-misaligned", "cifar-label-10", "cifar-truncated"],
)
def test_damaged_data_files_are_refused_naming_the_folder(tmp_path: Path, make, name: str, needle: str) -> None:
    root = make(tmp_path)
    load_dataset.cache_clear()
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        load_dataset(name, str(root))
    assert str(root) in str(info.value)
    load_dataset.cache_clear()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_data_root_that_is_not_a_folder_is_refused(tmp_path: Path, kind: str) -> None:
    """No silent fall-back to ./data or the system's data set."""
    root = tmp_path / "root"
    if kind == "file":
        root.write_text("x")
    load_dataset.cache_clear()
    with pytest.raises(DataMissingError, match="not a folder"):
        load_dataset("fashion-mnist", str(root))
