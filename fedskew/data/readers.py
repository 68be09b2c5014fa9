"""Readers for the standard files of FMNIST, MNIST, CIFAR-10/100 and SVHN (pure numpy + scipy)."""

from __future__ import annotations

import functools
import gzip
import os
import pickle
from pathlib import Path

import numpy as np

from fedskew.data.info import DATASET_INFO, DatasetInfo

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # x_train, y_train, x_test, y_test

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {
    "train-x": "train-images-idx3-ubyte",
    "train-y": "train-labels-idx1-ubyte",
    "test-x": "t10k-images-idx3-ubyte",
    "test-y": "t10k-labels-idx1-ubyte",
}
TORCHVISION_NAME = {
    "fashion-mnist": "FashionMNIST",
    "mnist": "MNIST",
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
    "svhn": "SVHN",
}
CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels"),
}
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")


class DataMissingError(FileNotFoundError):
    """The files of a data set are not where fedskew looks; the message says what to do."""


def default_roots(data_root: str) -> list[Path]:
    """Where to look, in order: the configured root (which must be a folder), then ./data and
    $FEDSKEW_DATA."""
    roots = [Path(data_root).expanduser()] if data_root else []
    if roots and not roots[0].is_dir():
        raise DataMissingError(f"data-root={data_root!r} is not a folder (missing, or a file)")
    roots.append(Path("data").absolute())
    if os.environ.get("FEDSKEW_DATA"):
        roots.append(Path(os.environ["FEDSKEW_DATA"]).expanduser())
    return roots


@functools.lru_cache(maxsize=2)
def load_dataset(name: str, data_root: str = "") -> Arrays:
    """Load `name` as uint8 images `[N, C, H, W]` and int64 labels; cached per process.

    Raises `DataMissingError` naming the files to provide when nothing is found.
    """
    roots = default_roots(data_root)
    if name in ("fashion-mnist", "mnist"):
        arrays = _load_idx_set(name, roots)
    elif name in CIFAR_FILES:
        arrays = _load_cifar(name, roots)
    elif name == "svhn":
        arrays = _load_svhn(roots)
    else:
        raise ValueError(f"unknown dataset {name!r}")
    for a in arrays:
        a.setflags(write=False)  # shared by every client in this process
    return arrays


def checked_split(
    name: str, folder: Path, split: str, x: np.ndarray, y: np.ndarray, info: DatasetInfo | None = None
) -> None:
    """One split's images and labels agree in number, images have the data set's shape and labels
    are its class ids (`info`, default: the standard set `name`'s); else ValueError naming the folder."""
    info = info or DATASET_INFO[name]
    where = f"{name} in {folder}, {split} split"
    if len(x) != len(y):
        raise ValueError(f"{where}: {len(x)} images but {len(y)} labels (truncated or mismatched files)")
    if x.shape[1:] != (info.channels, info.size, info.size):
        raise ValueError(
            f"{where}: images of shape {list(x.shape[1:])}, expected {[info.channels, info.size, info.size]}"
        )
    if len(y) and not (0 <= y.min() and y.max() < info.num_classes):
        raise ValueError(f"{where}: labels in [{y.min()}, {y.max()}], expected class ids in [0, {info.num_classes})")


# ----------------------------------------------------------------------------- IDX (MNIST family)


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped): magic, dims, then big-endian unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(tuple(dims))


def _idx_dirs(name: str, roots: list[Path]) -> list[Path]:
    dirs = []
    for r in roots:
        dirs += [r / name, r / TORCHVISION_NAME[name] / "raw", r]
    if name == "fashion-mnist":
        dirs.append(DEBIAN_FMNIST)
    return dirs


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_idx_set(name: str, roots: list[Path]) -> Arrays:
    dirs = _idx_dirs(name, roots)
    for folder in dirs:
        paths = {k: _find_idx(folder, stem) for k, stem in IDX_FILES.items()}
        if all(paths.values()):
            x_tr, y_tr = read_idx(paths["train-x"]), read_idx(paths["train-y"])
            x_te, y_te = read_idx(paths["test-x"]), read_idx(paths["test-y"])
            arrays = (x_tr[:, None], y_tr.astype(np.int64), x_te[:, None], y_te.astype(np.int64))
            checked_split(name, folder, "train", *arrays[:2])
            checked_split(name, folder, "test", *arrays[2:])
            return arrays
    files = ", ".join(f"{s}[.gz]" for s in IDX_FILES.values())
    hint = " or install Debian's package: apt-get install dataset-fashion-mnist" if name == "fashion-mnist" else ""
    raise DataMissingError(
        f"{name} not found: put {files} in {dirs[0]}{hint} (searched: {', '.join(str(d) for d in dirs)})"
    )


# ----------------------------------------------------------------------------- CIFAR


class _CifarUnpickler(pickle.Unpickler):
    """Accepts only what CIFAR's python batches hold: dicts, lists, bytes and numpy arrays."""

    ALLOWED: frozenset = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch file")


def read_cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch: `data` [N, 3072] uint8 and its labels; ValueError naming the file
    for anything else (including what the restricted unpickler refuses)."""
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        data, labels = batch[b"data"], batch[label_key]
        x = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
    except Exception as e:  # a damaged or hostile pickle can raise almost anything
        raise ValueError(f"{path}: not a CIFAR batch ({type(e).__name__}: {e})") from None
    return x, y


def _load_cifar(name: str, roots: list[Path]) -> Arrays:
    folder_name, train_files, test_files, label_key = CIFAR_FILES[name]
    dirs = _cifar_dirs(name, roots)
    for folder in dirs:
        if all((folder / f).is_file() for f in train_files + test_files):
            tr = [read_cifar_batch(folder / f, label_key) for f in train_files]
            te = [read_cifar_batch(folder / f, label_key) for f in test_files]
            arrays = (
                np.concatenate([x for x, _ in tr]),
                np.concatenate([y for _, y in tr]),
                np.concatenate([x for x, _ in te]),
                np.concatenate([y for _, y in te]),
            )
            checked_split(name, folder, "train", *arrays[:2])
            checked_split(name, folder, "test", *arrays[2:])
            return arrays
    raise DataMissingError(
        f"{name} not found: put the python version ({folder_name}/ with "
        f"{', '.join(train_files + test_files)}) under {roots[0]} "
        f"(searched: {', '.join(str(d) for d in dirs)})"
    )


# ----------------------------------------------------------------------------- SVHN


def read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """SVHN format 2: `X` [32, 32, 3, N] uint8, `y` [N, 1] with label 10 meaning digit 0."""
    from scipy.io import loadmat

    mat = loadmat(path)
    x = np.ascontiguousarray(np.transpose(mat["X"], (3, 2, 0, 1)), dtype=np.uint8)
    y = mat["y"].reshape(-1).astype(np.int64) % 10
    return x, y


def _load_svhn(roots: list[Path]) -> Arrays:
    dirs = _svhn_dirs(roots)
    for folder in dirs:
        tr, te = folder / "train_32x32.mat", folder / "test_32x32.mat"
        if tr.is_file() and te.is_file():
            arrays = (*read_svhn_mat(tr), *read_svhn_mat(te))
            checked_split("svhn", folder, "train", *arrays[:2])
            checked_split("svhn", folder, "test", *arrays[2:])
            return arrays
    raise DataMissingError(
        f"svhn not found: put train_32x32.mat and test_32x32.mat in {roots[0] / 'svhn'} "
        f"(searched: {', '.join(str(d) for d in dirs)})"
    )


# ----------------------------------------------------------------------------- where the files are


def _cifar_dirs(name: str, roots: list[Path]) -> list[Path]:
    folder = CIFAR_FILES[name][0]
    return [d for r in roots for d in (r / folder, r / TORCHVISION_NAME[name] / folder)]


def _svhn_dirs(roots: list[Path]) -> list[Path]:
    return [d for r in roots for d in (r / "svhn", r / "SVHN", r)]


def locate(name: str, data_root: str = "") -> Path | None:
    """The folder `load_dataset(name, data_root)` would read, or None when the files are missing
    (nothing is read: `fedskew data ls` / `data get` use it; a `data_root` that does not exist yet
    holds nothing)."""
    if data_root and not Path(data_root).expanduser().is_dir():
        return None
    roots = default_roots(data_root)
    if name in ("fashion-mnist", "mnist"):
        return next((d for d in _idx_dirs(name, roots) if all(_find_idx(d, s) for s in IDX_FILES.values())), None)
    if name in CIFAR_FILES:
        _, train_files, test_files, _ = CIFAR_FILES[name]
        wanted = train_files + test_files
        return next((d for d in _cifar_dirs(name, roots) if all((d / f).is_file() for f in wanted)), None)
    if name == "svhn":
        return next((d for d in _svhn_dirs(roots) if all((d / f).is_file() for f in SVHN_FILES)), None)
    raise ValueError(f"unknown dataset {name!r}")
