"""Hugging Face data sets (`dataset="hf:<repo or folder>"`): any labelled image data set of the Hub,
or a folder written by `datasets`' `save_to_disk` (works offline), turned into fedskew's uint8 arrays
so that fedskew's own label-skew partitions split it and every method runs on it.

- Source: an existing folder is read with `datasets.load_from_disk`; it must be a `save_to_disk`
  folder (holding `dataset_dict.json` or `state.json`), checked before anything inside it is read.
  Anything else is a Hub repo id read with `datasets.load_dataset(repo, name=hf-subset)` (Hugging
  Face's cache and `HF_*` settings apply). `datasets` is the optional extra `pip install 'fedskew[hf]'`.
  Flower Datasets' `FederatedDataset` loads through the same `datasets.load_dataset`; it is not used
  here because fedskew partitions the data itself (its partitioners would only be bypassed).
- Columns: `hf-image-column` / `hf-label-column`, or '' for the first `Image` / `ClassLabel`
  feature (else a column named image/img or label/labels/fine_label).
- Splits: `train` (or the only split) for training; `test` for the central test set, else a seeded
  (seed 0, the same for every run) `hf-test-fraction` of train is carved off as the test set.
- Images: PIL images of any mode, or arrays `[H, W]`, `[H, W, 1]` or `[H, W, 3]` of whole numbers
  0..255 (integers, or floats with whole values: a float array of [0, 1] intensities, NaN or values
  over 255 are refused rather than cast, which would give black or wrapped images). Grayscale stays
  one channel, anything else becomes RGB (a set mixing both becomes RGB). `hf-image-size` N resizes
  every image to N x N (bilinear), else all must be square, of one size and at most
  `MAX_IMAGE_SIZE` (256) pixels a side. An image over PIL's decompression-bomb limit
  (`PIL.Image.MAX_IMAGE_PIXELS`, about 89 million pixels) is refused, as is one that does not decode.
- Labels: integer class ids >= 0; classes from the `ClassLabel` feature, else the largest label + 1,
  at most `MAX_CLASSES` (10000) either way.
- Info (classes, channels, size, per-channel mean/std of the training images) comes from the data.
  Whether the model fits the images (`fedskew.models.check_input`) is checked before a run starts.
  Each refusal is one line naming the data set, the column, the split and row, and what is wrong.

Decoding a large set takes seconds, so the converted arrays are cached once per machine in
`$FEDSKEW_CACHE/hf` (else `~/.cache/fedskew/hf`), keyed by the settings, this file's code and, for a
folder, the fingerprints `datasets` writes into it (a changed folder is converted again). A Hub set is
keyed by repo and subset: after the repo changes, delete the cache file to convert it again. The cache
file stores SHA-256 digests of its info and of its arrays: a file that fails to load for any reason,
does not match its digests or whose info or labels are not of their form is converted again, and the
new file replaces it atomically.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedskew.data.info import HF_PREFIX, MAX_CLASSES, MAX_IMAGE_SIZE, DatasetInfo, dataset_slug
from fedskew.data.readers import DataMissingError, checked_split
from fedskew.files import arrays_digest, atomic_write

log = logging.getLogger("fedskew.data")
CACHE_FORMAT = 2
IMAGE_NAMES = ("image", "img", "pixel_values", "pixels")
LABEL_NAMES = ("label", "labels", "fine_label", "target", "class")
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")
META_KEYS = ("num_classes", "shape", "mean", "std")
DIGEST_KEYS = ("meta_digest", "array_digest")  # arrays_digest of META_KEYS and of ARRAY_KEYS
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at a folder's top


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
            if not any((path / marker).is_file() for marker in SAVED_MARKERS):
                raise DataMissingError(
                    f"hf:{self.source}: not a folder written by datasets' save_to_disk "
                    f"(it holds no {' or '.join(SAVED_MARKERS)})"
                )
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
    # save_to_disk's JSON files: at the top, and in each split's folder (state.json holds its _fingerprint)
    for p in sorted([*folder.glob("*.json"), *folder.glob("*/*.json")]):
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
    """The info of a conversion, after checking its form (ValueError)."""
    shape = [int(v) for v in np.asarray(meta["shape"]).reshape(-1)]
    num_classes = int(meta["num_classes"])
    if len(shape) != 3 or shape[0] not in (1, 3) or shape[1] != shape[2] or not 1 <= shape[1] <= MAX_IMAGE_SIZE:
        raise ValueError(f"image shape {shape} is not [1 or 3, N, N] with N in [1, {MAX_IMAGE_SIZE}]")
    if not 1 <= num_classes <= MAX_CLASSES:
        raise ValueError(f"{num_classes} classes, not in [1, {MAX_CLASSES}]")
    mean, std = (tuple(float(v) for v in np.asarray(meta[k]).reshape(-1)) for k in ("mean", "std"))
    values_ok = all(0 <= m <= 1 for m in mean) and all(0 < v <= 1 for v in std)
    if len(mean) != shape[0] or len(std) != shape[0] or not values_ok:
        raise ValueError(f"channel mean {mean} / std {std} are not {shape[0]} values in [0, 1] (std > 0)")
    return DatasetInfo(num_classes, shape[0], shape[1], mean, std)


def _read_cache(path: Path | None, with_arrays: bool) -> dict[str, np.ndarray] | None:
    """The cached info (and arrays) after checking them against the digests stored with them; None
    when there is no cache file, or (with a warning) when it fails in any way."""
    if path is None or not os.path.lexists(path):
        return None
    keys = META_KEYS + (ARRAY_KEYS if with_arrays else ())
    try:
        with np.load(path, allow_pickle=False) as z:  # members are read one by one: meta alone is cheap
            out = {k: z[k] for k in keys}
            stored = {k: str(z[k]) for k in DIGEST_KEYS}
        if stored["meta_digest"] != arrays_digest(out, META_KEYS):
            raise ValueError("its info does not match its digest")
        info = _as_info(out)
        if with_arrays:
            if stored["array_digest"] != arrays_digest(out, ARRAY_KEYS):
                raise ValueError("its arrays do not match their digest")
            checked_split(path.name, path.parent, "train", out["x_train"], out["y_train"], info)
            checked_split(path.name, path.parent, "test", out["x_test"], out["y_test"], info)
    except Exception as e:  # truncated, bit flips, edited, a folder of that name: convert again
        log.warning("hf cache %s refused (%s: %s): converting the data set again", path, type(e).__name__, e)
        return None
    return out


@functools.lru_cache(maxsize=2)
def _load(src: HFSource) -> tuple[tuple[np.ndarray, ...], DatasetInfo]:
    path = _cache_path(src)
    cached = _read_cache(path, with_arrays=True)
    if cached is None:
        cached = convert(src)
        if path is not None:
            digests = {
                "meta_digest": arrays_digest(cached, META_KEYS),
                "array_digest": arrays_digest(cached, ARRAY_KEYS),
            }
            try:
                atomic_write(path, lambda f: np.savez(f, **cached, **{k: np.array(v) for k, v in digests.items()}))
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
    meta = _read_cache(_cache_path(src), with_arrays=False)
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


def _array_image(value: Any, where: str) -> np.ndarray:
    """An array image (`[H, W]`, `[H, W, 1]` or `[H, W, 3]`, whole values 0..255) as uint8 `[H, W(, 3)]`."""
    a = np.asarray(value)
    if a.dtype == object or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3)) or 0 in a.shape:
        what = f"a value of type {type(value).__name__}" + (f" and shape {list(a.shape)}" if a.ndim else "")
        raise DataMissingError(
            f"{where}: {what} is not an image (a PIL image or an array [H, W], [H, W, 1] or [H, W, 3])"
        )
    if a.dtype.kind not in "uif":
        raise DataMissingError(f"{where}: pixels of type {a.dtype}: fedskew needs whole numbers 0..255")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all():
            raise DataMissingError(f"{where}: the image holds NaN or inf")
        if not np.array_equal(a, np.round(a)):
            bad = a[a != np.round(a)].flat[0]
            raise DataMissingError(f"{where}: float pixels such as {bad:g}: fedskew needs whole numbers 0..255")
    if a.min() < 0 or a.max() > 255:
        raise DataMissingError(f"{where}: pixel values in [{a.min():g}, {a.max():g}], outside 0..255")
    return a.astype(np.uint8)[..., 0] if a.ndim == 3 and a.shape[2] == 1 else a.astype(np.uint8)


def _pixels(value: Any, size: int, where: str) -> np.ndarray:
    """One image (PIL or array) as uint8 `[H, W]` (grayscale) or `[H, W, 3]`."""
    from PIL import Image

    if not isinstance(value, Image.Image):
        value = Image.fromarray(_array_image(value, where))
    img = value.convert("L" if value.mode in GRAY_MODES else "RGB")
    if size:
        img = img.resize((size, size), Image.Resampling.BILINEAR)
    elif max(img.size) > MAX_IMAGE_SIZE:
        raise DataMissingError(
            f"{where}: a {img.size[0]}x{img.size[1]} image, over {MAX_IMAGE_SIZE} pixels a side: "
            f"set hf-image-size (at most {MAX_IMAGE_SIZE}) to resize the images"
        )
    return np.asarray(img, dtype=np.uint8)


def column_values(split: Any, column: str, where: str) -> Iterator[tuple[str, Any]]:
    """(`where` + row number, value) for each row of `split`'s `column`, decoded by `datasets`; an
    image that does not decode or is over PIL's decompression-bomb limit raises one line."""
    from PIL import Image

    rows = iter(split.select_columns([column]))
    for i in itertools.count():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)  # the limit, not twice it
                row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # a damaged file, a decompression bomb: anything PIL or datasets raises
            first = (str(e).splitlines() or [""])[0][:200]
            raise DataMissingError(f"{where} row {i}: the image does not decode: {type(e).__name__}: {first}") from None
        yield f"{where} row {i}", row[column]


def images_to_array(images: Iterable[tuple[str, Any]], size: int, name: str) -> np.ndarray:
    """Decoded images, each with where it comes from -> uint8 `[N, C, H, W]`; grayscale is widened to
    RGB when the set mixes both. `name`: the data set, for the messages."""
    arrays = [_pixels(v, size, where) for where, v in images]
    if not arrays:
        raise DataMissingError(f"{name}: the data set holds no images")
    rgb = any(a.ndim == 3 for a in arrays)
    arrays = [np.repeat(a[..., None], 3, axis=2) if rgb and a.ndim == 2 else a for a in arrays]
    shapes = {a.shape[:2] for a in arrays}
    if len(shapes) > 1 or any(h != w for h, w in shapes):
        shown = ", ".join(f"{h}x{w}" for h, w in sorted(shapes)[:3])
        raise DataMissingError(
            f"{name}: images of size {shown}: fedskew needs square images of one size; set hf-image-size"
        )
    x = np.stack(arrays)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if rgb else x[:, None])


def _labels(split: Any, column: str, where: str) -> np.ndarray:
    y = np.asarray(split[column])
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataMissingError(f"{where}: label column {column!r} must hold integer class ids, not {y.dtype}")
    if len(y) and y.min() < 0:
        raise DataMissingError(f"{where}: label column {column!r} holds negative labels (unlabelled rows?)")
    if len(y) and y.max() >= MAX_CLASSES:
        raise DataMissingError(
            f"{where}: label column {column!r} holds the label {y.max()}: fedskew allows at most {MAX_CLASSES} "
            f"classes (labels 0..{MAX_CLASSES - 1})"
        )
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
    where = {name: f"hf:{src.source}: {name} split" for name in ("train", "test")}
    y_train, y_test = _labels(train, label_col, where["train"]), _labels(test, label_col, where["test"])
    if len(y_train) == 0:
        raise DataMissingError(f"hf:{src.source}: the train split is empty")
    rows = (
        row
        for name, split in (("train", train), ("test", test))
        for row in column_values(split, image_col, f"{where[name]}, column {image_col!r},")
    )
    x = images_to_array(rows, src.image_size, f"hf:{src.source}")  # both splits at once: one channel count
    feature = features[label_col]
    top = int(max(y_train.max(), y_test.max(initial=0)))
    num_classes = feature.num_classes if isinstance(feature, datasets.ClassLabel) else top + 1
    if top >= num_classes:
        raise DataMissingError(f"hf:{src.source}: label {top} exceeds the {num_classes} classes of {label_col!r}")
    if num_classes > MAX_CLASSES:
        raise DataMissingError(
            f"hf:{src.source}: the ClassLabel {label_col!r} has {num_classes} classes: fedskew allows at most "
            f"{MAX_CLASSES}"
        )
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
