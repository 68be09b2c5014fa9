"""Data sets read from their standard file formats, and each client's partition.

Readers (no torchvision needed):
- Fashion-MNIST / MNIST: the four IDX files (`train-images-idx3-ubyte[.gz]` ...), looked up in
  `<root>/<name>/`, `<root>/<TorchvisionName>/raw/`, `<root>/` and, for Fashion-MNIST, Debian's
  `/usr/share/datasets/fashion-mnist/` (package `dataset-fashion-mnist`).
- CIFAR-10 / CIFAR-100: the python batch files (`cifar-10-batches-py/`, `cifar-100-python/`),
  unpickled by a restricted unpickler that only accepts the numpy types those files contain.
- SVHN: `train_32x32.mat` / `test_32x32.mat` (format 2), read with scipy.io.

Images are kept as uint8 `[N, C, H, W]` in a per-process cache and turned into normalised float
tensors only for the slice a client needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedskew.data.readers import DataMissingError, load_dataset

__all__ = ["DATASET_INFO", "DataMissingError", "DatasetInfo", "load_dataset"]


@dataclass(frozen=True)
class DatasetInfo:
    """Shape and normalisation of a data set."""

    num_classes: int
    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


DATASET_INFO: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo(10, 1, 28, (0.2860,), (0.3530,)),
    "mnist": DatasetInfo(10, 1, 28, (0.1307,), (0.3081,)),
    "cifar10": DatasetInfo(10, 3, 32, (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": DatasetInfo(100, 3, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": DatasetInfo(10, 3, 32, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
