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

import dataclasses
from typing import Any

import numpy as np

from fedskew.data import hf
from fedskew.data.info import (
    DATASET_INFO,
    HF_PREFIX,
    MAX_CLASSES,
    MAX_IMAGE_SIZE,
    DatasetInfo,
    dataset_slug,
    is_hf,
)
from fedskew.data.readers import DataMissingError, load_dataset

__all__ = [
    "DATASET_INFO",
    "HF_PREFIX",
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


def dataset_info(cfg: dict[str, Any] | str) -> DatasetInfo:
    """Classes, channels, size and mean/std of the configured data set (a validated run config,
    or the name of a standard set); for `hf:` data sets measured on the data (cached). Under the
    run's `input-scaling` 'unit' the mean is 0 and the std 1, so that `to_float` stops at [0, 1]."""
    name = cfg if isinstance(cfg, str) else cfg["dataset"]
    if name in DATASET_INFO:
        info = DATASET_INFO[name]
    elif isinstance(cfg, str) or not is_hf(name):
        raise ValueError(f"unknown dataset {name!r}" + (": pass the run config" if is_hf(name) else ""))
    else:
        info = hf.info(hf.HFSource.from_cfg(cfg))
    if not isinstance(cfg, str) and cfg.get("input-scaling", "standardise") == "unit":
        return dataclasses.replace(info, mean=(0.0,) * info.channels, std=(1.0,) * info.channels)
    return info


def load_arrays(cfg: dict[str, Any], data_root: str | None = None) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) of the configured data set: uint8 `[N, C, H, W]` images and
    int64 labels, cached per process. `data_root` overrides the config's (a node's own folder).

    A missing standard set raises `DataMissingError` naming the files and `fedskew data get`."""
    name = cfg["dataset"]
    if is_hf(name):
        return hf.load(hf.HFSource.from_cfg(cfg))
    root = cfg["data-root"] if data_root is None else data_root
    try:
        return load_dataset(name, root)
    except DataMissingError as e:
        where = f" --data-root {root}" if root else ""
        raise DataMissingError(f"{e}; or download it: fedskew data get {name}{where}") from None
