"""Node configuration: a node's data from its node config, through the on-disk cache; the
participation counter in client state; the server logging sampled nodes that never replied."""

from __future__ import annotations

import gzip
import io
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.config import validate
from fedskew.data import node as node_mod
from fedskew.data.clients import load_client_data
from fedskew.data.node import cache_key, load_node_data, node_data_spec

CFG = validate({})


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (gzipped), the format of the MNIST family."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def own_data(tmp_path: Path) -> Path:
    """A node's own small Fashion-MNIST-format data set: 60 train images of classes 3 and 7."""
    folder = tmp_path / "site" / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    y = np.array([3, 7] * 30)
    write_idx(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (60, 28, 28)))
    write_idx(folder / "train-labels-idx1-ubyte.gz", y)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (10, 28, 28)))
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.arange(10))
    return tmp_path / "site"


def test_cached_partition_equals_the_computed_one_and_loads_fast(tmp_path: Path, monkeypatch) -> None:
    nc = {"partition-id": 3, "num-partitions": 20, "cache-dir": str(tmp_path)}
    spec, first = load_node_data(CFG, nc)
    assert (spec.partition_id, spec.num_partitions, spec.own_data) == (3, 20, False)
    ref = load_client_data(CFG, 3, 20)
    for a, b in [(first.x_train, ref.x_train), (first.y_train, ref.y_train), (first.x_test, ref.x_test)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(list(tmp_path.glob("*.npz"))) == 1

    def no_recompute(*a, **k):
        raise AssertionError("the cached slice was recomputed")

    monkeypatch.setattr(node_mod, "compute_slice", no_recompute)
    t0 = time.perf_counter()
    _, again = load_node_data(CFG, nc)
    assert time.perf_counter() - t0 < 1.0
    assert torch.equal(again.x_train, ref.x_train) and torch.equal(again.y_test, ref.y_test)


def test_a_fresh_process_starts_from_the_cache_without_recomputing(tmp_path: Path) -> None:
    """What a deployment's per-message ClientApp process does: read the slice from the cache, in a
    fresh process where recomputing it would raise (the speed-up itself is a benchmark's to show:
    timed comparisons fail on a loaded machine)."""
    nc = {"partition-id": 1, "num-partitions": 10, "cache-dir": str(tmp_path)}
    _, ref = load_node_data(CFG, nc)
    code = (
        "import torch\nfrom fedskew.config import validate\nfrom fedskew.data import node\n"
        "def refuse(*a, **k):\n    raise AssertionError('recomputed')\n"
        f"node.compute_slice = refuse\nspec, data = node.load_node_data(validate({{}}), {nc!r})\n"
        f"torch.save((data.x_train[:5], data.y_test), {str(tmp_path / 'got.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    x, y = torch.load(tmp_path / "got.pt")
    assert torch.equal(x, ref.x_train[:5]) and torch.equal(y, ref.y_test)


def test_cache_key_follows_every_setting_that_shapes_the_slice() -> None:
    spec = node_data_spec({"partition-id": 0, "num-partitions": 5}, CFG)
    key = cache_key(CFG, spec)
    assert key == cache_key(dict(CFG), spec)
    changed = [
        cache_key({**CFG, "seed": 1}, spec),
        cache_key({**CFG, "classes-per-client": 3}, spec),
        cache_key({**CFG, "partition": "dirichlet"}, spec),
        cache_key({**CFG, "local-test-fraction": 0.1}, spec),
        cache_key(CFG, node_data_spec({"partition-id": 1, "num-partitions": 5}, CFG)),
        cache_key(CFG, node_data_spec({"partition-id": 0, "num-partitions": 6}, CFG)),
    ]
    assert len({key, *changed}) == len(changed) + 1
    assert cache_key({**CFG, "lr": 0.5, "method": "fedprox"}, spec) == key  # training keys do not matter


def test_a_damaged_cache_file_is_recomputed(tmp_path: Path) -> None:
    nc = {"partition-id": 2, "num-partitions": 20, "cache-dir": str(tmp_path)}
    _, good = load_node_data(CFG, nc)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip file")
    _, again = load_node_data(CFG, nc)
    assert torch.equal(again.x_train, good.x_train)
    assert np.load(path)["y_train"].shape[0] == len(good.y_train)  # rewritten


def test_a_process_checks_a_cached_slice_once_and_again_after_any_change(tmp_path: Path, monkeypatch) -> None:
    nc = {"partition-id": 5, "num-partitions": 20, "cache-dir": str(tmp_path)}
    _, first = load_node_data(CFG, nc)  # computed and written
    calls = []
    digest = node_mod.slice_digest
    monkeypatch.setattr(node_mod, "slice_digest", lambda a: calls.append(1) or digest(a))
    load_node_data(CFG, nc)
    load_node_data(CFG, nc)
    assert len(calls) == 1  # checked on the first read only
    # one pixel changed in place (same file, same size), its times set back: only the ctime tells
    (path,) = tmp_path.glob("*.npz")
    st = path.stat()
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in node_mod.SLICE_ARRAYS}
    arrays["x_train"][0, 0, 0] ^= 0xFF
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    assert len(buf.getvalue()) == st.st_size
    with open(path, "r+b") as f:
        f.write(buf.getvalue())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    _, again = load_node_data(CFG, nc)
    assert len(calls) == 3  # checked again: refused (digest), then the recomputed slice is written
    assert torch.equal(again.x_train, first.x_train)


def test_own_data_mode_uses_the_node_folder_and_caches_beside_it(own_data: Path) -> None:
    nc = {"partition-id": 7, "data-root": str(own_data)}
    spec, data = load_node_data(CFG, nc)
    assert (spec.partition_id, spec.num_partitions, spec.own_data) == (7, 0, True)
    assert len(data.y_train) + len(data.y_test) == 60  # all of the node's own training images
    assert set(data.y_train.tolist()) == {3, 7} and set(data.y_test.tolist()) == {3, 7}
    assert len(list((own_data / ".fedskew-cache").glob("fashion-mnist-own-*.npz"))) == 1
    # the same folder with num-partitions: the node serves one partition of it
    spec, part = load_node_data(CFG, {**nc, "partition-id": 1, "num-partitions": 2})
    assert not spec.own_data and len(part.y_train) + len(part.y_test) < 60


@pytest.mark.parametrize(
    ("node_config", "error"),
    [
        ({"num-partitions": 2}, KeyError),
        ({"partition-id": 2, "num-partitions": 2}, ValueError),
        ({"partition-id": 0}, KeyError),
        ({"partition-id": 0, "data-root": "/no/such/folder"}, FileNotFoundError),
    ],
)
def test_bad_node_configs_fail_clearly(node_config: dict, error: type) -> None:
    with pytest.raises(error, match=r"partition|data-root"):
        node_data_spec(node_config, CFG)


def test_client_state_counts_participations_across_messages(tmp_path: Path, task_identity: None) -> None:
    """The ClientApp, called three times with one Context (as a SuperNode does), reports 1, 2, 3."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from fedskew.client_app.app import app
    from fedskew.models import build_model

    rc = {"num-server-rounds": 3, "partition": "classes-per-client", "local-epochs": 1}
    nc = {"partition-id": 4, "num-partitions": 40, "cache-dir": str(tmp_path)}
    ctx = Context(run_id=1, node_id=7, node_config=nc, state=RecordDict(), run_config=rc)
    arrays = ArrayRecord(build_model("lenet", "fashion-mnist").state_dict())
    counts = []
    for r in (1, 2, 3):
        msg = Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": r})}),
            dst_node_id=7,
            message_type="train",
        )
        reply = app(msg, ctx)
        assert not reply.has_error(), reply.error
        counts.append(int(reply.content["metrics"]["participations"]))
        assert int(reply.content["metrics"]["partition-id"]) == 4
    assert counts == [1, 2, 3]


class FakeGrid:
    """Answers `query.info` with partition ids; the train round is handled by the test."""

    def __init__(self, nodes: dict[int, int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import ConfigRecord, Message, RecordDict

        return [
            Message(
                RecordDict(
                    {"info": ConfigRecord({"partition-id": self.nodes[m.metadata.dst_node_id], "num-partitions": 3})}
                ),
                reply_to=m,
            )
            for m in messages
        ]


def test_server_logs_dead_and_silent_nodes(task_identity: None) -> None:
    """A reply the SuperLink makes for a node without heartbeat (sent by the SuperLink itself) is
    charged to that node; a node that sends nothing before the timeout is logged too; the round
    still aggregates the reply that arrived."""
    from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

    from fedskew.strategies.fedavg import FedAvgStrategy

    strategy = FedAvgStrategy(validate({"fraction-train": 1.0, "partition": "iid"}))
    grid = FakeGrid({101: 0, 202: 1, 303: 2})
    arrays = strategy.initial_arrays()
    sent = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    for m in sent:  # what Grid.push_messages does
        m.metadata.__dict__["_message_id"] = m.object_id
    by_node = {m.metadata.dst_node_id: m for m in sent}
    ok = Message(
        RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5, "partition-id": 0})}),
        reply_to=by_node[101],
    )
    dead = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=by_node[202])
    dead.metadata.__dict__["_src_node_id"] = 1  # the SuperLink answers for the dead node
    new, metrics = strategy.aggregate_train(1, [ok, dead])
    assert new is not None and metrics["replies"] == 1 and metrics["failures"] == 2
    assert {(f["partition"], f["reason"][:12]) for f in strategy.failures} == {
        (1, "Error: Node "),
        (2, "no reply wit"),
    }


def test_the_cache_folder_is_bounded_least_recently_used_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSKEW_CACHE_MAX_MB", "0.001")  # room for no slice beyond the newest
    for pid in (0, 1):
        load_node_data(CFG, {"partition-id": pid, "num-partitions": 20, "cache-dir": str(tmp_path)})
    (left,) = tmp_path.glob("*.npz")
    assert "-p1of20-" in left.name
