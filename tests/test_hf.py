"""`dataset="hf:..."`: tiny data sets made with Hugging Face `datasets`, saved to disk, read offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets  # the `hf` extra; `dev` installs it too
import numpy as np
import pytest

from fedskew.config import validate
from fedskew.data import DataMissingError, clients, dataset_info, hf, load_arrays

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch, tmp_path: Path):
    """Each test converts into its own cache folder, and starts with empty in-process caches."""
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    caches = (hf._load, hf.info, clients._client_indices)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def images(n: int, size: int = 12, rgb: bool = True) -> np.ndarray:
    return RNG.integers(0, 256, (n, size, size, 3) if rgb else (n, size, size)).astype(np.uint8)


def save(folder: Path, splits: dict[str, dict], features: dict) -> Path:
    feats = datasets.Features(features)
    dd = datasets.DatasetDict({k: datasets.Dataset.from_dict(v, features=feats) for k, v in splits.items()})
    dd.save_to_disk(str(folder))
    return folder


def usual(folder: Path, n_train: int = 40, n_test: int = 12, classes: int = 5, size: int = 12) -> tuple[Path, dict]:
    """image (Image) + label (ClassLabel of `classes`, label classes-1 never used) in train and test."""
    data = {
        split: {"image": list(images(n, size)), "label": (np.arange(n) % (classes - 1)).tolist()}
        for split, n in (("train", n_train), ("test", n_test))
    }
    label = datasets.ClassLabel(names=[f"c{i}" for i in range(classes)])
    return save(folder, data, {"image": datasets.Image(), "label": label}), data


def cfg_for(folder: Path | str, **kw) -> dict:
    return validate({"dataset": f"hf:{folder}", "partition": "iid", "min-partition-size": 1, **kw})


def test_a_saved_folder_loads_with_its_info_measured_on_the_data(tmp_path: Path) -> None:
    folder, data = usual(tmp_path / "tiny")
    cfg = cfg_for(folder)
    x, y, x2, y2 = load_arrays(cfg)
    assert x.shape == (40, 3, 12, 12) and x.dtype == np.uint8 and x2.shape == (12, 3, 12, 12)
    assert np.array_equal(x, np.stack(data["train"]["image"]).transpose(0, 3, 1, 2))  # PNG: lossless
    assert y.tolist() == data["train"]["label"] and y2.tolist() == data["test"]["label"] and y.dtype == np.int64
    info = dataset_info(cfg)
    assert (info.num_classes, info.channels, info.size) == (5, 3, 12)  # classes from the ClassLabel feature
    pixels = x.astype(np.float64) / 255
    assert np.allclose(info.mean, pixels.mean(axis=(0, 2, 3))) and np.allclose(info.std, pixels.std(axis=(0, 2, 3)))
    assert not x.flags.writeable


def test_other_column_names_need_the_config_keys(tmp_path: Path) -> None:
    n = 30
    split = {"picture": list(images(n, rgb=False)), "digit": (np.arange(n) % 3).tolist(), "note": ["a"] * n}
    folder = save(
        tmp_path / "cols",
        {"train": split},
        {"picture": datasets.Image(), "digit": datasets.Value("int64"), "note": datasets.Value("string")},
    )
    with pytest.raises(DataMissingError, match="set hf-label-column") as info:
        load_arrays(cfg_for(folder))
    assert "\n" not in str(info.value)
    with pytest.raises(DataMissingError, match="hf-label-column='nope': no such column"):
        load_arrays(cfg_for(folder, **{"hf-label-column": "nope"}))
    with pytest.raises(DataMissingError, match="must hold integer class ids"):
        load_arrays(cfg_for(folder, **{"hf-label-column": "note"}))
    cfg = cfg_for(folder, **{"hf-label-column": "digit", "hf-image-column": "picture"})
    x, _, x2, _ = load_arrays(cfg)
    assert x.shape[1:] == (1, 12, 12) and len(x) + len(x2) == n  # grayscale stays one channel
    assert dataset_info(cfg).num_classes == 3  # no ClassLabel: the largest label + 1


def test_without_a_test_split_a_fixed_share_is_carved_off(tmp_path: Path) -> None:
    folder, _ = usual(tmp_path / "one", n_train=50)
    only_train = datasets.load_from_disk(str(folder))["train"]
    only_train.save_to_disk(str(tmp_path / "plain"))  # a Dataset, not a DatasetDict
    a = load_arrays(cfg_for(tmp_path / "plain", seed=1, **{"hf-test-fraction": 0.3}))
    hf._load.cache_clear()
    b = load_arrays(cfg_for(tmp_path / "plain", seed=7, **{"hf-test-fraction": 0.3}))
    assert len(a[2]) == 15 and len(a[0]) == 35
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))  # the same split for every seed
    rows = {bytes(img) for img in np.concatenate([a[0], a[2]])}
    assert len(rows) == 50  # disjoint, and together all of train


def test_sizes_modes_and_resizing(tmp_path: Path) -> None:
    mixed = [*images(6, 10, rgb=False), *images(6, 10, rgb=True)]
    folder = save(
        tmp_path / "mixed",
        {"train": {"img": mixed, "label": [0, 1] * 6}},
        {"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=2)},
    )
    x = load_arrays(cfg_for(folder, **{"hf-test-fraction": 0.5}))[0]
    assert x.shape[1] == 3  # a set mixing grayscale and RGB becomes RGB
    uneven = [*images(3, 10), *images(3, 14)]
    folder = save(
        tmp_path / "uneven",
        {"train": {"img": uneven, "label": [0, 1] * 3}},
        {"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=2)},
    )
    with pytest.raises(DataMissingError, match="set hf-image-size"):
        load_arrays(cfg_for(folder))
    cfg = cfg_for(folder, **{"hf-image-size": 8})
    assert load_arrays(cfg)[0].shape[1:] == (3, 8, 8) and dataset_info(cfg).size == 8


def test_the_conversion_is_cached_and_a_changed_folder_is_converted_again(tmp_path: Path, monkeypatch) -> None:
    folder, _ = usual(tmp_path / "cached")
    cfg = cfg_for(folder)
    first = load_arrays(cfg)
    assert len(list((tmp_path / "cache" / "hf").glob("hf-cached-*.npz"))) == 1
    hf._load.cache_clear()
    hf.info.cache_clear()

    def no_conversion(src):
        raise AssertionError("converted again")

    monkeypatch.setattr(hf, "convert", no_conversion)  # a new process reads the cache file
    assert dataset_info(cfg).num_classes == 5
    assert all(np.array_equal(u, v) for u, v in zip(first, load_arrays(cfg), strict=True))
    monkeypatch.undo()
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    import shutil

    shutil.rmtree(folder)
    usual(folder, n_train=20)  # new data in the same folder: new fingerprints
    hf._load.cache_clear()
    assert len(load_arrays(cfg)[0]) == 20


def test_hub_repos_go_through_datasets_load_dataset(tmp_path: Path, monkeypatch) -> None:
    folder, _ = usual(tmp_path / "hub-copy")
    calls = []

    def fake_load_dataset(path, name=None, **kw):
        calls.append((path, name))
        if path == "org/offline":
            raise ConnectionError("Couldn't reach 'org/offline' on the Hub (LocalEntryNotFoundError)")
        return datasets.load_from_disk(str(folder))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = validate({"dataset": "hf:org/tiny", "hf-subset": "plain", "partition": "iid", "min-partition-size": 1})
    assert load_arrays(cfg)[0].shape == (40, 3, 12, 12) and calls == [("org/tiny", "plain")]
    with pytest.raises(DataMissingError, match=r"cannot load this Hugging Face Hub repo.*offline: save it") as info:
        load_arrays(validate({"dataset": "hf:org/offline"}))
    assert "\n" not in str(info.value)
    with pytest.raises(DataMissingError, match="no such folder"):
        load_arrays(validate({"dataset": f"hf:{tmp_path}/missing"}))


def test_config_checks_need_no_data() -> None:
    cfg = validate({"dataset": "hf:someone/never-downloaded", "classes-per-client": 50})  # classes unknown yet
    assert cfg["hf-image-size"] == 0
    for bad, needle in (({"hf-image-size": -1}, "hf-image-size=-1"), ({"hf-test-fraction": 0.0}, "hf-test-fraction")):
        with pytest.raises(Exception, match=needle):
            validate({"dataset": "hf:x/y", **bad})


def test_fedskew_run_sends_a_relative_folder_as_an_absolute_one(tmp_path: Path, monkeypatch) -> None:
    from fedskew.run.launcher import prepare_config
    from tests.conftest import ROOT

    usual(tmp_path / "rel", size=16)  # LeNet (the default model) takes 16 x 16 and more
    monkeypatch.chdir(tmp_path)
    _, overrides = prepare_config(ROOT, {"dataset": "hf:rel", "partition": "iid", "min-partition-size": 1}, 3)
    assert overrides["dataset"] == f"hf:{tmp_path / 'rel'}" and overrides["run-name"].startswith("fedavg-hf-rel-iid-")


def test_an_hf_folder_runs_end_to_end_in_process(tmp_path: Path, task_identity) -> None:
    """ServerApp + ClientApps (in-process harness) on a saved folder: partition, node cache, training
    with the model shaped from the data, central evaluation on the test split."""
    from tests.harness import run_in_process

    folder, _ = usual(tmp_path / "e2e", n_train=60, n_test=20, size=28)
    out = tmp_path / "out"
    cfg = {"dataset": f"hf:{folder}", "partition": "iid", "min-partition-size": 1, "model": "lenet"}
    cfg.update({"num-server-rounds": 1, "fraction-train": 1.0, "out-dir": str(out), "run-name": "hf"})
    run_in_process(cfg, 2)
    rows = [json.loads(line) for line in (out / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["replies"] == 2 and 0.0 <= rows[0]["global-accuracy"] <= 1.0
    assert len(json.loads((out / "hf" / "partition.json").read_text())["train"][0]) == 5  # the ClassLabel's 5


@pytest.mark.slow
def test_an_hf_folder_through_a_real_flwr_run(flwr_job, tmp_path: Path) -> None:
    """The same through `flwr run` (Ray workers convert nothing: they read the cache file)."""
    folder, _ = usual(tmp_path / "real", n_train=60, n_test=20, size=28)
    job = {"dataset": f"hf:{folder}", "partition": "iid", "min-partition-size": 1, "num-server-rounds": 1}
    summary, run_dir = flwr_job(job, num_supernodes=2, name="hf")
    assert summary["rounds"] == 1 and summary["dataset"] == f"hf:{folder}"
    assert (run_dir / "metrics.jsonl").is_file()


def test_a_node_serving_its_own_data_needs_a_standard_set(tmp_path: Path) -> None:
    from fedskew.data.node import node_data_spec

    with pytest.raises(ValueError, match="serve a partition of an hf: data set with num-partitions"):
        node_data_spec({"partition-id": 0, "data-root": str(tmp_path)}, validate({"dataset": "hf:org/x"}))


# ----------------------------------------------------------------------------- refused before a run starts


def _one_split(folder: Path, column: list, feature: Any, n: int = 8) -> Path:
    split = {"img": column, "label": [i % 2 for i in range(n)]}
    return save(folder, {"train": split}, {"img": feature, "label": datasets.ClassLabel(num_classes=2)})


def _preflight(folder: Path | str, **kw: Any) -> None:
    """What `fedskew run` checks before anything starts (the launcher's pre-flight)."""
    from fedskew.run.launcher import prepare_config
    from tests.conftest import ROOT

    prepare_config(ROOT, {"dataset": f"hf:{folder}", "partition": "iid", "min-partition-size": 1, **kw}, 2)


def _bomb() -> bytes:
    """A 10000 x 10000 PNG of 12 kB: over PIL's decompression-bomb limit of about 89 million pixels."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, "PNG")
    return buf.getvalue()


def _arrays(shape: tuple[int, ...], dtype: str, value: float, n: int = 8) -> list:
    return [np.full(shape, value, dtype=dtype) for _ in range(n)]


BAD_IMAGES = {  # name -> (column, feature, what the one line says)
    "float intensities in [0, 1]": (
        _arrays((16, 16), "float32", 0.5),
        datasets.Array2D((16, 16), "float32"),
        "float pixels such as 0.5",
    ),
    "NaN pixels": (_arrays((16, 16), "float32", np.nan), datasets.Array2D((16, 16), "float32"), "NaN"),
    "pixels over 255": (_arrays((16, 16), "int32", 300), datasets.Array2D((16, 16), "int32"), "outside 0..255"),
    "5 channels": (_arrays((16, 16, 5), "uint8", 7), datasets.Array3D((16, 16, 5), "uint8"), "[H, W, 3]"),
    "integers, not images": (list(range(8)), datasets.Value("int64"), "type int is not an image"),
    "a decompression bomb": (
        [{"bytes": _bomb(), "path": None}] * 8,
        datasets.Image(),
        "does not decode: DecompressionBomb",
    ),
    "300-pixel images": (
        list(images(8, 300)),
        datasets.Image(),
        "a 300x300 image, over 256 pixels a side: set hf-image-size",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_images_fedskew_cannot_use_are_refused_in_one_line_before_anything_starts(tmp_path: Path, case: str) -> None:
    column, feature, needle = BAD_IMAGES[case]
    folder = _one_split(tmp_path / "bad", column, feature)
    with pytest.raises(DataMissingError) as info:
        _preflight(folder, **{"hf-image-column": "img"})
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg
    assert msg.startswith(f"hf:{folder}: train split, column 'img', row 0: ")  # where, then what


def test_whole_float_and_integer_arrays_are_images(tmp_path: Path) -> None:
    column = [np.arange(256, dtype=np.float64).reshape(16, 16)] * 8  # whole values 0..255 as floats
    folder = _one_split(tmp_path / "ok", column, datasets.Array2D((16, 16), "float64"))
    x = load_arrays(cfg_for(folder, **{"hf-image-column": "img", "hf-test-fraction": 0.25}))[0]
    assert x.dtype == np.uint8 and x.shape == (6, 1, 16, 16) and np.array_equal(x[0, 0], column[0])


def test_a_huge_label_without_class_names_is_refused_before_any_allocation(tmp_path: Path) -> None:
    split = {"image": list(images(8, 16)), "label": [0, 1, 2, 3, 4, 5, 6, 2**31]}
    folder = save(tmp_path / "huge", {"train": split}, {"image": datasets.Image(), "label": datasets.Value("int64")})
    with pytest.raises(DataMissingError, match=r"holds the label 2147483648: fedskew allows at most 10000 classes"):
        _preflight(folder)


def test_image_sizes_the_model_cannot_take_are_refused_before_anything_starts(tmp_path: Path) -> None:
    from fedskew.config import ConfigError

    folder, _ = usual(tmp_path / "tiny", size=1)
    with pytest.raises(ConfigError, match=r"model='lenet' takes images of 16 to 256 pixels .* 1x1"):
        _preflight(folder)
    _preflight(folder, model="mlp")  # any size
    with pytest.raises(ConfigError, match="hf-image-size=3000 is not allowed"):
        _preflight(folder, **{"hf-image-size": 3000})
    from fedskew.config import COMMON
    from fedskew.data import MAX_IMAGE_SIZE

    assert COMMON["hf-image-size"].high == MAX_IMAGE_SIZE  # the config's bound is the data's


@pytest.mark.parametrize("name", ["lenet", "map-lenet", "mupfl-cnn", "tfcnn", "mlp", "vgg11", "resnet8"])
def test_each_models_smallest_image_is_exact(name: str) -> None:
    """The declared smallest size runs forward; one pixel less fails in the network (when it has a bound)."""
    import torch

    from fedskew.data import DatasetInfo
    from fedskew.models import MIN_SIZE, MODELS, build_model

    low = MIN_SIZE.get(name, 1)
    info = DatasetInfo(3, 1, low, (0.5,), (0.5,))
    assert build_model(name, info).eval()(torch.zeros(2, 1, low, low)).shape == (2, 3)
    if low > 1:
        with pytest.raises(RuntimeError):
            MODELS[name](1, low - 1, 3)(torch.zeros(2, 1, low - 1, low - 1))


def test_a_folder_that_is_not_a_saved_data_set_is_refused_without_walking_it(monkeypatch) -> None:
    def no_walk(self, pattern):
        raise AssertionError(f"walked {self} for {pattern}")

    monkeypatch.setattr(Path, "rglob", no_walk)
    with pytest.raises(DataMissingError, match=r"hf:/: not a folder written by datasets' save_to_disk"):
        load_arrays(cfg_for("/"))


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "a folder"])
def test_a_damaged_hf_cache_is_converted_again_and_replaced(tmp_path: Path, monkeypatch, damage: str) -> None:
    folder, _ = usual(tmp_path / "cached")
    cfg = cfg_for(folder)
    first, info = load_arrays(cfg), dataset_info(cfg)
    (path,) = (tmp_path / "cache" / "hf").glob("hf-cached-*.npz")
    blob = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    elif damage == "bit flip":
        blob[len(blob) // 2] ^= 0x10  # inside the images: only the digest tells
        path.write_bytes(bytes(blob))
    else:
        path.unlink()
        path.mkdir()
    conversions = []
    real = hf.convert
    monkeypatch.setattr(hf, "convert", lambda src: conversions.append(src) or real(src))
    for _ in range(2):  # a new process each time: the info alone, then the arrays
        hf._load.cache_clear()
        hf.info.cache_clear()
        assert dataset_info(cfg) == info
        assert all(np.array_equal(u, v) for u, v in zip(first, load_arrays(cfg), strict=True))
        if damage != "a folder":  # replaced by a good file: the next process reads it
            assert len(conversions) == 1
    assert path.is_file() == (damage != "a folder")
