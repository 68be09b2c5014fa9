"""Data sets read from their standard file formats or from Hugging Face, and each client's partition.

Readers (no torchvision needed):
- Fashion-MNIST / MNIST: the four IDX files (`train-images-idx3-ubyte[.gz]` ...), looked up in
  `<root>/<name>/`, `<root>/<TorchvisionName>/raw/`, `<root>/` and, for Fashion-MNIST, Debian's
  `/usr/share/datasets/fashion-mnist/` (package `dataset-fashion-mnist`).
- CIFAR-10 / CIFAR-100: the python batch files (`cifar-10-batches-py/`, `cifar-100-python/`),
  unpickled by a restricted unpickler that only accepts the numpy types those files contain.
- SVHN: `train_32x32.mat` / `test_32x32.mat` (format 2), read with scipy.io.
- `hf:<repo or folder>`: any labelled image data set of the Hugging Face Hub, or a folder written by
  `datasets`' `save_to_disk` (see `fedskew.data.hf`); its shape and normalisation come from the data.

`fedskew data get NAME` downloads the five standard sets (see `fedskew.data.download`).
Images are kept as uint8 `[N, C, H, W]` in a per-process cache and turned into normalised float
tensors only for the slice a client needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedskew.data.readers import DataMissingError, load_dataset

__all__ = [
    "DATASET_INFO",
    "MAX_CLASSES",
    "MAX_IMAGE_SIZE",
    "DataMissingError",
    "DatasetInfo",
    "dataset_info",
    "dataset_slug",
    "is_hf",
    "load_arrays",
    "load_dataset",
]

HF_PREFIX = "hf:"
# Bounds of any data set (the standard ones are far inside; `fedskew.data.hf` checks hf: sets):
MAX_IMAGE_SIZE = 256  # pixels a side: ImageNet-style 224 fits; the small models' sizes grow with its square
MAX_CLASSES = 10_000  # per-class tensors (partitions, FedGELA's ETF, MuPFL's features) grow with it


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


def is_hf(name: str) -> bool:
    """True for `hf:<repo or folder>` data sets."""
    return name.startswith(HF_PREFIX)


def dataset_slug(name: str) -> str:
    """`name` made safe for a file or folder name (`hf:uoft-cs/cifar10` -> `hf-cifar10`)."""
    if not is_hf(name):
        return name
    tail = name[len(HF_PREFIX) :].rstrip("/").rsplit("/", 1)[-1]
    return "hf-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", tail).strip("-.") or "data")


def dataset_info(cfg: dict[str, Any] | str) -> DatasetInfo:
    """Classes, channels, size and mean/std of the configured data set (a validated run config,
    or the name of a standard set); for `hf:` data sets measured on the data (cached)."""
    name = cfg if isinstance(cfg, str) else cfg["dataset"]
    if name in DATASET_INFO:
        return DATASET_INFO[name]
    if isinstance(cfg, str) or not is_hf(name):
        raise ValueError(f"unknown dataset {name!r}" + (": pass the run config" if is_hf(name) else ""))
    from fedskew.data import hf

    return hf.info(hf.HFSource.from_cfg(cfg))


def load_arrays(cfg: dict[str, Any], data_root: str | None = None) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) of the configured data set: uint8 `[N, C, H, W]` images and
    int64 labels, cached per process. `data_root` overrides the config's (a node's own folder).

    A missing standard set raises `DataMissingError` naming the files and `fedskew data get`."""
    name = cfg["dataset"]
    if is_hf(name):
        from fedskew.data import hf

        return hf.load(hf.HFSource.from_cfg(cfg))
    root = cfg["data-root"] if data_root is None else data_root
    try:
        return load_dataset(name, root)
    except DataMissingError as e:
        where = f" --data-root {root}" if root else ""
        raise DataMissingError(f"{e}; or download it: fedskew data get {name}{where}") from None
