"""What describes a data set without reading it: its shape and normalisation (`DatasetInfo`), the
standard sets' (`DATASET_INFO`), the bounds of any set and the `hf:` names. Imports nothing of
fedskew: the readers, the Hugging Face loader and the package's `__init__.py` all take it from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
