"""A SuperNode's local data, from its node config, through an on-disk cache.

In deployment every message starts a fresh `flwr-clientapp` process, so nothing survives in
memory between rounds; recomputing the partition (read the whole data set, partition it, cut the
local test split) each round would cost seconds. The node's slice is therefore written once to
`<cache-dir>/<key>.npz` (uint8 images and labels, train and local test) and read back on every
later message (milliseconds). The simulation uses the same code path.

Node config keys (all optional except as noted):

- `partition-id`, `num-partitions`: serve client `partition-id` of the configured partition of the
  data set (simulation always sets both).
- `data-root`: where this node's data files are (overrides the run config's `data-root` on this
  node). With `num-partitions` the node serves its partition of the data set found there; without
  `num-partitions` the whole data set under `data-root` is the node's own local data (split into
  local train/test by `local-test-fraction`), and `partition-id` (required, unique) only names it.
  An `hf:` data set names its own source, so it is always served as partitions (`data-root` unused).
- `cache-dir`: the cache folder (default `<data-root>/.fedskew-cache` when that is writable, else
  `$FEDSKEW_CACHE`, else `~/.cache/fedskew`).

The cache key hashes every setting that determines the slice (the partition keys of
`fedskew.data.clients.PARTITION_KEYS`, the resolved data root, the node's ids, the mode) and the
source of the partitioning code, so a changed setting or a code update never reads a stale slice.
The file is `<key>-<digest>.npz`, the digest a SHA-256 of the slice's arrays: a slice that fails to
load for any reason (truncated, bit flips, not a zip, a folder of that name), does not match its
digest (damaged, or edited) or whose labels are not class ids is deleted and recomputed, and the
recomputed slice replaces it atomically.
A process checks a file once while it stays the same file (its inode, size and ctime; a simulation
actor serves the same clients round after round).
Changing the data files in place is not detected: delete the cache folder then. The folder is
bounded: after a write, the least recently used slices (by mtime, refreshed at most every 10
minutes) beyond `$FEDSKEW_CACHE_MAX_MB` (default 2048) are deleted. Only fedskew's own slices
(`CACHE_FILE`) are ever deleted: the cache folder may be shared with other files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.data import DATASET_INFO, DatasetInfo, dataset_info, dataset_slug, is_hf, load_arrays
from fedskew.data.clients import PARTITION_KEYS, ClientData, client_indices, partition_key, split_seed, to_float
from fedskew.data.readers import checked_split
from fedskew.files import arrays_digest, atomic_write

log = logging.getLogger("fedskew.client")
CACHE_FORMAT = 2
_CODE_FILES = ("partitions/core.py", "data/clients.py", "data/readers.py", "data/node.py", "data/hf.py")
SLICE_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
# fedskew's own cached slices (format 1 had no digest): the only files `prune` ever deletes
_DATASET_SLUG = "|".join([*map(re.escape, DATASET_INFO), r"hf-[A-Za-z0-9._-]+"])
CACHE_FILE = re.compile(rf"(?:{_DATASET_SLUG})-(?:own|p\d+of\d+)-[0-9a-f]{{20}}(?:-[0-9a-f]{{16}})?\.npz")


@dataclass(frozen=True)
class NodeData:
    """What a node serves: its id, the partition count it reports (0 = own data) and how."""

    partition_id: int
    num_partitions: int
    data_root: str
    own_data: bool


def node_data_spec(node_config: Mapping[str, Any], cfg: dict[str, Any]) -> NodeData:
    """Read `partition-id`, `num-partitions` and `data-root` from the node config."""
    data_root = str(node_config.get("data-root", "") or cfg["data-root"])
    if "partition-id" not in node_config:
        raise KeyError(
            "node config lacks 'partition-id': start the SuperNode with "
            "--node-config 'partition-id=0 num-partitions=2' (or 'partition-id=0 data-root=\"/my/data\"')"
        )
    pid = int(node_config["partition-id"])
    if "num-partitions" in node_config:
        num = int(node_config["num-partitions"])
        if not 0 <= pid < num:
            raise ValueError(f"node config partition-id={pid} must be in [0, num-partitions={num})")
        return NodeData(pid, num, data_root, own_data=False)
    if not node_config.get("data-root"):
        raise KeyError(
            "node config lacks 'num-partitions' (serve a partition) or 'data-root' (serve your own data): "
            "--node-config 'partition-id=0 num-partitions=2'"
        )
    if not Path(data_root).expanduser().is_dir():
        raise FileNotFoundError(f"node config data-root={data_root!r} is not a folder")
    if is_hf(cfg["dataset"]):
        raise ValueError(
            f"dataset={cfg['dataset']!r}: a node's own data (data-root without num-partitions) must be one of the "
            "standard data sets; serve a partition of an hf: data set with num-partitions"
        )
    if pid < 0:
        raise ValueError(f"node config partition-id={pid} must be >= 0")
    return NodeData(pid, 0, data_root, own_data=True)


def _code_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _CODE_FILES:
        p = root / rel
        h.update(p.read_bytes() if p.is_file() else rel.encode())
    return h.hexdigest()[:16]


def cache_key(cfg: dict[str, Any], spec: NodeData) -> str:
    """A file name that changes whenever anything that determines the node's slice changes."""
    settings = dict(zip(PARTITION_KEYS, partition_key(cfg), strict=True))  # the split's seed resolved
    settings["data-root"] = str(Path(spec.data_root).expanduser().resolve()) if spec.data_root else ""
    if spec.own_data:  # the partition scheme does not apply to a node's own data
        settings = {k: settings[k] for k in ("dataset", "data-root", "local-test-fraction", "seed")}
    if is_hf(cfg["dataset"]):  # a changed save_to_disk folder gives new slices
        from fedskew.data import hf

        settings["hf-data"] = hf.fingerprint(hf.HFSource.from_cfg(cfg))
    blob = json.dumps(
        {"format": CACHE_FORMAT, "code": _code_digest(), "settings": settings, "node": spec.__dict__}, sort_keys=True
    )
    digest = hashlib.sha256(blob.encode()).hexdigest()[:20]
    tag = "own" if spec.own_data else f"p{spec.partition_id}of{spec.num_partitions}"
    return f"{dataset_slug(cfg['dataset'])}-{tag}-{digest}"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def cache_dir(node_config: Mapping[str, Any], spec: NodeData) -> Path | None:
    """The first usable of: node config `cache-dir`, `<data-root>/.fedskew-cache`,
    `$FEDSKEW_CACHE`, `~/.cache/fedskew`; None if none is writable (then nothing is cached)."""
    candidates = []
    if node_config.get("cache-dir"):
        candidates.append(Path(str(node_config["cache-dir"])).expanduser())
    if spec.data_root:
        candidates.append(Path(spec.data_root).expanduser() / ".fedskew-cache")
    if os.environ.get("FEDSKEW_CACHE"):
        candidates.append(Path(os.environ["FEDSKEW_CACHE"]).expanduser())
    candidates.append(Path.home() / ".cache" / "fedskew")
    return next((c for c in candidates if _writable(c)), None)


def compute_slice(cfg: dict[str, Any], spec: NodeData) -> dict[str, np.ndarray]:
    """The node's uint8 images and labels (train and local test) from the full data set."""
    x, y, _, _ = load_arrays(cfg, spec.data_root)
    if spec.own_data:
        from fedskew.partitions import split_local_test

        rng = np.random.default_rng([split_seed(cfg), spec.partition_id])
        tr, te = split_local_test(np.arange(len(y)), y, cfg["local-test-fraction"], rng)
    else:
        tr, te = client_indices({**cfg, "data-root": spec.data_root}, spec.num_partitions)[spec.partition_id]
    return {"x_train": x[tr], "y_train": y[tr], "x_test": x[te], "y_test": y[te]}


def slice_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 (16 hex digits) of a slice: every array's name, dtype, shape and bytes."""
    return arrays_digest(arrays, SLICE_ARRAYS)


# Slices this process has checked, by path: the file's identity (device, inode, size, ctime in ns)
# when it was checked. A file with the same identity is the same bytes (any write or rename changes
# the inode or the ctime, which no user call can set back; on a file system with nanosecond times,
# as ext4, xfs, btrfs, tmpfs and overlayfs have), so a simulation actor that serves the same client
# again skips the SHA-256 (about 4 ms of a 1-epoch client call of about 0.2 s). Keyed by the file
# only, so it stays right when Ray reuses the process for another run.
_CHECKED: dict[str, tuple[int, int, int, int]] = {}
TOUCH_AFTER_S = 600  # a slice's mtime (its recency for `prune`) is refreshed at most this often


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns


def read_cached(folder: Path, key: str, info: DatasetInfo) -> dict[str, np.ndarray] | None:
    """The cached slice `key` after checking it against the digest in its name and its labels
    (once per process while the file stays the same: `_CHECKED`); a cached slice that fails is
    deleted (it is ours: its name says so), with a warning."""
    for path in sorted(folder.glob(f"{key}-*.npz")):
        try:
            with open(path, "rb") as f:  # identity and bytes from one open file
                st = os.fstat(f.fileno())
                with np.load(f, allow_pickle=False) as z:
                    arrays = {k: z[k] for k in SLICE_ARRAYS}
            if _CHECKED.get(str(path)) != _identity(st):
                if path.stem.rsplit("-", 1)[-1] != slice_digest(arrays):
                    raise ValueError("its arrays do not match the digest in its name")
                checked_split(key, path, "train", arrays["x_train"], arrays["y_train"], info)
                checked_split(key, path, "test", arrays["x_test"], arrays["y_test"], info)
                _CHECKED[str(path)] = _identity(st)
        except Exception as e:  # any failure to load (truncated, bit flips, edited): recompute and rewrite
            _CHECKED.pop(str(path), None)
            log.warning("data cache %s refused (%s: %s): recomputing the slice", path, type(e).__name__, e)
            if CACHE_FILE.fullmatch(path.name):
                with contextlib.suppress(OSError):  # e.g. a folder of that name: the rewrite will say so
                    path.unlink()
            continue
        if time.time() - st.st_mtime > TOUCH_AFTER_S:
            os.utime(path)  # recently used: kept by `prune` (a new ctime: checked again on the next read)
        return arrays
    return None


def write_cached(folder: Path, key: str, arrays: dict[str, np.ndarray]) -> Path:
    """Cache a slice as `<key>-<digest>.npz`, atomically (nodes sharing the folder never read half a file)."""
    path = folder / f"{key}-{slice_digest(arrays)}.npz"
    atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def prune(folder: Path, max_bytes: int, keep: Path) -> None:
    """Delete the least recently used of fedskew's cached slices (never `keep`, never another
    file) until they hold at most `max_bytes`."""
    files = []
    for p in folder.glob("*.npz"):
        if not CACHE_FILE.fullmatch(p.name):
            continue
        try:
            st = p.stat()
        except OSError:  # removed by a concurrent node
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        if p == keep:
            continue
        p.unlink(missing_ok=True)
        total -= size


def load_node_slice(cfg: dict[str, Any], node_config: Mapping[str, Any]) -> tuple[NodeData, dict[str, np.ndarray]]:
    """The node's spec and raw slice, from the cache when present (else computed and cached)."""
    spec = node_data_spec(node_config, cfg)
    folder, key = cache_dir(node_config, spec), cache_key(cfg, spec)
    cached = read_cached(folder, key, dataset_info(cfg)) if folder else None
    if cached is not None:
        return spec, cached
    arrays = compute_slice(cfg, spec)
    if folder is not None:
        try:
            path = write_cached(folder, key, arrays)
            prune(folder, int(float(os.environ.get("FEDSKEW_CACHE_MAX_MB", "2048")) * 2**20), keep=path)
        except OSError as e:
            log.warning("could not write the data cache in %s: %s", folder, e)
    return spec, arrays


def load_node_data(cfg: dict[str, Any], node_config: Mapping[str, Any]) -> tuple[NodeData, ClientData]:
    """The node's local data as normalised tensors (the `ClientData` every trainer uses)."""
    spec, a = load_node_slice(cfg, node_config)
    info = dataset_info(cfg)
    data = ClientData(
        to_float(a["x_train"], info),
        torch.from_numpy(a["y_train"].astype(np.int64)),
        to_float(a["x_test"], info),
        torch.from_numpy(a["y_test"].astype(np.int64)),
        info.num_classes,
    )
    return spec, data
