"""Each client's local train/test tensors, and the central test set, from the cached arrays."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedskew.data import DATASET_INFO, DatasetInfo, dataset_info, load_arrays
from fedskew.partitions import partition, split_local_test
from fedskew.partitions.stats import class_counts

PARTITION_KEYS = (
    "dataset",
    "data-root",
    "partition",
    "classes-per-client",
    "classes-per-client-mode",
    "dirichlet-alpha",
    "min-partition-size",
    "imbalance-factor",
    "map-sigma",
    "local-test-fraction",
    "seed",
    "partition-seed",
    "hf-subset",
    "hf-image-column",
    "hf-label-column",
    "hf-image-size",
    "hf-test-fraction",
)

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI checks partitions without it (1 s)
    import torch


@dataclass
class ClientData:
    """A client's local data as normalised float tensors (on CPU)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def train_counts(self) -> np.ndarray:
        """Samples per class in the local training split, `[num_classes]` int64."""
        return np.bincount(self.y_train.numpy(), minlength=self.num_classes)


def to_float(x: np.ndarray, info: DatasetInfo | str) -> torch.Tensor:
    """uint8 `[N, C, H, W]` -> float32, scaled to [0, 1] and normalised per channel (`info`: the
    data set's, or the name of a standard set)."""
    import torch

    info = DATASET_INFO[info] if isinstance(info, str) else info
    t = torch.from_numpy(np.array(x, dtype=np.float32)).div_(255.0)
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    return t.sub_(mean).div_(std)


def partition_key(cfg: dict[str, Any]) -> tuple:
    """`cfg`'s `PARTITION_KEYS` values with the split's seed resolved (`split_seed` as `seed`,
    `partition-seed` -1): one key for every run that splits the data alike, whatever its own seed."""
    resolved = {**cfg, "seed": split_seed(cfg), "partition-seed": -1}
    return tuple(resolved[k] for k in PARTITION_KEYS)


@functools.lru_cache(maxsize=4)
def _client_indices(key: tuple, num_clients: int) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = dict(zip(PARTITION_KEYS, key, strict=True))
    _, y_train, _, _ = load_arrays(cfg)
    parts = partition(y_train, num_clients, cfg, seed=cfg["seed"])  # the split's seed (`partition_key`)
    return [
        split_local_test(p, y_train, cfg["local-test-fraction"], np.random.default_rng([cfg["seed"], k]))
        for k, p in enumerate(parts)
    ]


def split_seed(cfg: dict[str, Any]) -> int:
    """The seed of the data split: `partition-seed`, or the run's `seed` where it is -1."""
    return cfg["seed"] if cfg["partition-seed"] < 0 else cfg["partition-seed"]


def client_indices(cfg: dict[str, Any], num_clients: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index arrays into the training set for every client; cached per process."""
    return _client_indices(partition_key(cfg), num_clients)


def client_class_counts(cfg: dict[str, Any], num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """Images per client and class `[K, C]` of the configured partition: (training, local test)."""
    _, y_train, _, _ = load_arrays(cfg)
    parts = client_indices(cfg, num_clients)
    c = dataset_info(cfg).num_classes
    return class_counts(y_train, [tr for tr, _ in parts], c), class_counts(y_train, [te for _, te in parts], c)


def load_client_data(cfg: dict[str, Any], partition_id: int, num_partitions: int) -> ClientData:
    """The local data of client `partition_id` of `num_partitions`."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id={partition_id} must be in [0, num-partitions={num_partitions})")
    import torch

    x, y, _, _ = load_arrays(cfg)
    tr, te = client_indices(cfg, num_partitions)[partition_id]
    info = dataset_info(cfg)
    return ClientData(
        to_float(x[tr], info), torch.from_numpy(y[tr]), to_float(x[te], info), torch.from_numpy(y[te]), info.num_classes
    )


def load_test_set(cfg: dict[str, Any], data_root: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The official test split (balanced, all classes) for central evaluation; `data_root`: a node's
    own data folder instead of the config's."""
    import torch

    _, _, x, y = load_arrays(cfg, data_root)
    return to_float(x, dataset_info(cfg)), torch.from_numpy(y.copy())
