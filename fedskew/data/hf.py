"""Hugging Face data sets (`dataset="hf:<repo or folder>"`): any labelled image data set of the Hub,
or a folder written by `datasets`' `save_to_disk` (works offline), turned into fedskew's uint8 arrays
so that fedskew's own label-skew partitions split it and every method runs on it.

- Source: an existing folder is read with `datasets.load_from_disk`; anything else is a Hub repo id
  read with `datasets.load_dataset(repo, name=hf-subset)` (Hugging Face's cache and `HF_*` settings
  apply). `datasets` is the optional extra `pip install 'fedskew[hf]'`. Flower Datasets'
  `FederatedDataset` loads through the same `datasets.load_dataset`; it is not used here because
  fedskew partitions the data itself (its partitioners would only be bypassed).
- Columns: `hf-image-column` / `hf-label-column`, or '' for the first `Image` / `ClassLabel`
  feature (else a column named image/img or label/labels/fine_label).
- Splits: `train` (or the only split) for training; `test` for the central test set, else a seeded
  (seed 0, the same for every run) `hf-test-fraction` of train is carved off as the test set.
- Images: grayscale stays one channel, anything else becomes RGB (a set mixing both becomes RGB);
  `hf-image-size` N resizes every image to N x N (bilinear), else all must be square and equal.
- Info (classes, channels, size, per-channel mean/std of the training images) comes from the data:
  classes from the `ClassLabel` feature, else the largest label + 1.

Decoding a large set takes seconds, so the converted arrays are cached once per machine in
`$FEDSKEW_CACHE/hf` (else `~/.cache/fedskew/hf`), keyed by the settings, this file's code and, for a
folder, the fingerprints `datasets` writes into it (a changed folder is converted again). A Hub set is
keyed by repo and subset: after the repo changes, delete the cache file to convert it again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data import HF_PREFIX, DataMissingError, DatasetInfo, dataset_slug
from fedskew.files import atomic_write

log = logging.getLogger("fedskew.data")
CACHE_FORMAT = 1
IMAGE_NAMES = ("image", "img", "pixel_values", "pixels")
LABEL_NAMES = ("label", "labels", "fine_label", "target", "class")
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")
META_KEYS = ("num_classes", "shape", "mean", "std")


@dataclass(frozen=True)
class HFSource:
    """Where a Hugging Face data set comes from and how it becomes arrays (the `hf-*` config keys)."""

    source: str
    subset: str = ""
    image_column: str = ""
    label_column: str = ""
    image_size: int = 0
    test_fraction: float = 0.2

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> HFSource:
        return cls(
            source=cfg["dataset"][len(HF_PREFIX) :],
            subset=cfg["hf-subset"],
            image_column=cfg["hf-image-column"],
            label_column=cfg["hf-label-column"],
            image_size=cfg["hf-image-size"],
            test_fraction=cfg["hf-test-fraction"],
        )

    @property
    def folder(self) -> Path | None:
        """The local folder, or None for a Hub repo id (a path-like source that does not exist raises)."""
        path = Path(self.source).expanduser()
        if path.is_dir():
            return path.resolve()
        if self.source.startswith(("/", ".", "~")) or not self.source:
            raise DataMissingError(f"hf:{self.source}: no such folder (write one with datasets' save_to_disk)")
        return None


def fingerprint(src: HFSource) -> str:
    """What identifies the data behind `src`: for a folder its path and the fingerprints `datasets`
    stored in it, for a Hub repo its id."""
    folder = src.folder
    if folder is None:
        return f"hub:{src.source}"
    h = hashlib.sha256(str(folder).encode())
    for p in sorted(folder.rglob("*.json")):  # state.json holds each split's _fingerprint
        h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return f"dir:{h.hexdigest()[:20]}"


def _cache_path(src: HFSource) -> Path | None:
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    settings = {**asdict(src), "source": fingerprint(src)}  # a folder by its resolved path and content
    blob = json.dumps({"format": CACHE_FORMAT, "code": code, "settings": settings}, sort_keys=True)
    name = f"{dataset_slug(HF_PREFIX + src.source)}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.npz"
    roots = [Path(os.environ["FEDSKEW_CACHE"]).expanduser()] if os.environ.get("FEDSKEW_CACHE") else []
    roots.append(Path.home() / ".cache" / "fedskew")
    for root in roots:
        try:
            (root / "hf").mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root / "hf", os.W_OK):
            return root / "hf" / name
    return None


def _as_info(meta: dict[str, np.ndarray]) -> DatasetInfo:
    channels, size, _ = (int(v) for v in meta["shape"])
    mean, std = (tuple(float(v) for v in meta[k]) for k in ("mean", "std"))
    return DatasetInfo(int(meta["num_classes"]), channels, size, mean, std)


def _read_cache(path: Path | None, keys: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:  # members are read one by one: meta alone is cheap
            return {k: z[k] for k in keys}
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring unreadable hf cache %s: %s", path, e)
        return None


@functools.lru_cache(maxsize=2)
def _load(src: HFSource) -> tuple[tuple[np.ndarray, ...], DatasetInfo]:
    path = _cache_path(src)
    cached = _read_cache(path, ARRAY_KEYS + META_KEYS)
    if cached is None:
        cached = convert(src)
        if path is not None:
            try:
                atomic_write(path, lambda f: np.savez(f, **cached))
            except OSError as e:
                log.warning("could not write the hf cache %s: %s", path, e)
    arrays = tuple(cached[k] for k in ARRAY_KEYS)
    for a in arrays:
        a.setflags(write=False)  # shared by every client in this process
    return arrays, _as_info(cached)


def load(src: HFSource) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) as uint8 `[N, C, H, W]` and int64 labels."""
    return _load(src)[0]


@functools.lru_cache(maxsize=4)
def info(src: HFSource) -> DatasetInfo:
    """Classes, channels, size and mean/std measured on the data (from the cache's small members when
    the arrays are not needed in this process, e.g. a client reading its slice from the node cache)."""
    meta = _read_cache(_cache_path(src), META_KEYS)
    return _as_info(meta) if meta is not None else _load(src)[1]


# ----------------------------------------------------------------------------- conversion


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataMissingError(
            "hf: data sets need the Hugging Face `datasets` package: pip install 'fedskew[hf]'"
        ) from None
    return datasets


def _open(src: HFSource) -> dict[str, Any]:
    """The data set's splits as a dict of `datasets.Dataset`."""
    datasets = _import_datasets()
    folder = src.folder
    try:
        if folder is not None:
            loaded = datasets.load_from_disk(str(folder))
        else:
            loaded = datasets.load_dataset(src.source, name=src.subset or None)
    except Exception as e:  # network, missing repo, bad folder: one clear line
        where = "folder" if folder is not None else "Hugging Face Hub repo"
        hint = "" if folder is not None else " (offline: save it with datasets' save_to_disk, use hf:/that/folder)"
        first = (str(e).splitlines() or [""])[0][:300]
        raise DataMissingError(
            f"hf:{src.source}: cannot load this {where}: {type(e).__name__}: {first}{hint}"
        ) from None
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def _pick_splits(splits: dict[str, Any], src: HFSource) -> tuple[Any, Any | None]:
    if "train" not in splits and len(splits) != 1:
        raise DataMissingError(f"hf:{src.source}: no 'train' split among {sorted(splits)}")
    return splits.get("train", next(iter(splits.values()))), splits.get("test")


def _pick_column(features: dict[str, Any], key: str, wanted: str, kind: type, names: tuple[str, ...]) -> str:
    """The column named by config `key`, else the first feature of type `kind`, else a usual name."""
    if wanted:
        if wanted not in features:
            raise DataMissingError(f"{key}={wanted!r}: no such column (columns: {', '.join(features)})")
        return wanted
    typed = [name for name, feature in features.items() if isinstance(feature, kind)]
    found = typed + [name for name in names if name in features]
    if not found:
        usual = "/".join(names)
        raise DataMissingError(f"set {key}: no {kind.__name__} column nor one named {usual} ({', '.join(features)})")
    return found[0]


def _pixels(value: Any, size: int) -> np.ndarray:
    """One image (PIL or array) as uint8 `[H, W]` (grayscale) or `[H, W, 3]`."""
    from PIL import Image

    if not isinstance(value, Image.Image):
        value = Image.fromarray(np.asarray(value).astype(np.uint8))
    img = value.convert("L" if value.mode in GRAY_MODES else "RGB")
    if size:
        img = img.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


def images_to_array(images: Iterable[Any], size: int = 0) -> np.ndarray:
    """Decoded images -> uint8 `[N, C, H, W]`; grayscale is widened to RGB when the set mixes both."""
    arrays = [_pixels(v, size) for v in images]
    if not arrays:
        raise DataMissingError("the data set holds no images")
    rgb = any(a.ndim == 3 for a in arrays)
    arrays = [np.repeat(a[..., None], 3, axis=2) if rgb and a.ndim == 2 else a for a in arrays]
    shapes = {a.shape[:2] for a in arrays}
    if len(shapes) > 1 or any(h != w for h, w in shapes):
        shown = ", ".join(f"{h}x{w}" for h, w in sorted(shapes)[:3])
        raise DataMissingError(f"images of size {shown}: fedskew needs square images of one size; set hf-image-size")
    x = np.stack(arrays)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if rgb else x[:, None])


def _labels(split: Any, column: str, source: str) -> np.ndarray:
    y = np.asarray(split[column])
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataMissingError(f"hf:{source}: label column {column!r} must hold integer class ids, not {y.dtype}")
    if len(y) and y.min() < 0:
        raise DataMissingError(f"hf:{source}: label column {column!r} holds negative labels (unlabelled rows?)")
    return y.astype(np.int64)


def channel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images `[N, C, H, W]` scaled to [0, 1] (a std of 0 -> 1)."""
    s, s2 = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for i in range(0, len(x), chunk):
        b = x[i : i + chunk].astype(np.float64) / 255.0
        s += b.sum(axis=(0, 2, 3))
        s2 += (b * b).sum(axis=(0, 2, 3))
    n = max(x.shape[0] * x.shape[2] * x.shape[3], 1)
    mean = s / n
    std = np.sqrt(np.maximum(s2 / n - mean * mean, 0.0))
    return mean, np.where(std > 1e-8, std, 1.0)


def convert(src: HFSource) -> dict[str, np.ndarray]:
    """Load and decode the data set: the four arrays and the info (`META_KEYS`) as numpy arrays."""
    datasets = _import_datasets()
    train, test = _pick_splits(_open(src), src)
    features = dict(train.features)
    image_col = _pick_column(features, "hf-image-column", src.image_column, datasets.Image, IMAGE_NAMES)
    label_col = _pick_column(features, "hf-label-column", src.label_column, datasets.ClassLabel, LABEL_NAMES)
    log.info("hf:%s: images from column %r, labels from %r", src.source, image_col, label_col)
    if test is None:  # carve a fixed test split, the same for every run and seed
        order = np.random.default_rng(0).permutation(len(train))
        n_test = round(src.test_fraction * len(train))
        test, train = train.select(np.sort(order[:n_test])), train.select(np.sort(order[n_test:]))
    missing = {image_col, label_col} - set(test.features)
    if missing:
        raise DataMissingError(f"hf:{src.source}: the test split lacks column(s) {sorted(missing)}")
    y_train, y_test = _labels(train, label_col, src.source), _labels(test, label_col, src.source)
    if len(y_train) == 0:
        raise DataMissingError(f"hf:{src.source}: the train split is empty")
    rows = (r[image_col] for split in (train, test) for r in split.select_columns([image_col]))
    x = images_to_array(rows, src.image_size)  # both splits at once: one channel count
    feature = features[label_col]
    top = int(max(y_train.max(), y_test.max(initial=0)))
    num_classes = feature.num_classes if isinstance(feature, datasets.ClassLabel) else top + 1
    if top >= num_classes:
        raise DataMissingError(f"hf:{src.source}: label {top} exceeds the {num_classes} classes of {label_col!r}")
    mean, std = channel_stats(x[: len(y_train)])
    return {
        "x_train": x[: len(y_train)],
        "y_train": y_train,
        "x_test": x[len(y_train) :],
        "y_test": y_test,
        "num_classes": np.array(num_classes),
        "shape": np.array(x.shape[1:]),
        "mean": mean,
        "std": std,
    }
