"""Hostile clients: a malformed or lying reply or node report is a logged failure that is
counted in failures.jsonl, never an exception, and never reaches the model or the method's state.

Honest replies come from the real ClientApp (tests/harness.py: 4 nodes serving partitions 0-3 of
20); one node's reply is then replaced by a hostile one. The result must equal the round in which
that node sent nothing at all.
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedskew.client_app.app import PARTICIPATION
from fedskew.config import validate
from fedskew.methods.creff import CREFF_CLASSIFIER, CREFF_GRADS
from fedskew.methods.feddc import FEDDC_UPDATE as UPDATE
from fedskew.methods.fedgen import FEDGEN_COUNTS, FEDGEN_GENERATOR
from fedskew.methods.fedmr import FEDMR_PROTOTYPES as PROTO_RECORD
from fedskew.methods.fedproc import FEDPROC_PROTOTYPES as FEDPROC
from fedskew.methods.fedproto import FEDPROTO_PROTOTYPES as FEDPROTO
from fedskew.methods.mupfl import MUPFL_GRADS as GRADS
from fedskew.methods.mupfl import MUPFL_MAPS as MAPS
from fedskew.methods.mupfl import MUPFL_TIMES as TIMES
from fedskew.methods.scaffold import CONTROL
from fedskew.registry import get_method
from tests.harness import InProcessGrid, app_defaults, run_in_process

NODES, PARTITIONS = 4, 50
COMMON = {"model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 1, "eval-every": 100}
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "map": {},
    "fedmr": {"fedmr-share-fraction": 0.5, "fedmr-private-classes": "0"},
    "mupfl": {"model": "lenet", "mupfl-match-iters": 3, "mupfl-tau": 1},
    "fedgela": {},
    "scaffold": {},
    "scaffold-rs": {"partition": "classes-per-client"},
    "fednova": {},
    "feddyn": {},
    "feddc": {},
    "moon": {},
    "fedproc": {},
    "fedlc": {},
    "fedmmd": {},
    "fedaws": {},
    "fedgen": {"fedgen-iterations": 3},
    "creff": {"creff-features-per-class": 5, "creff-match-iters": 3, "creff-retrain-epochs": 2},
    "fedproto": {},
    "fedphp": {},
    "ditto": {},
    "fedrep": {"fedrep-head-epochs": 2},
    "fedbabu": {"fedbabu-finetune-epochs": 1},
    "fedrod": {},
}
Edit = Callable[[RecordDict, dict[str, Any]], RecordDict]


# ---------------------------------------------------------------------------------------------- edits
def with_records(content: RecordDict, **records: Any) -> RecordDict:
    out = RecordDict(dict(content.items()))
    for name, rec in records.items():
        out[name.replace("_", "-")] = rec
    return out


def metric(**values: Any) -> Edit:
    """Set (or add) reply metrics; names use '_' for '-'."""

    def edit(content: RecordDict, ctx: dict[str, Any]) -> RecordDict:
        m = dict(content["metrics"])
        m.update({k.replace("_", "-"): (v(ctx) if callable(v) else v) for k, v in values.items()})
        return with_records(content, metrics=MetricRecord(m))

    return edit


def npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


def first_array_bytes(make: Callable[[tuple[int, ...]], bytes]) -> Edit:
    """The first model array keeps its declared float32 dtype and shape; its bytes are `make(shape)`."""

    def edit(content: RecordDict, ctx: dict[str, Any]) -> RecordDict:
        arrays = dict(content["arrays"].items())
        key = next(iter(arrays))
        a = arrays[key]
        arrays[key] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=make(tuple(a.shape)))
        return with_records(content, arrays=ArrayRecord(arrays))

    return edit


def record(name: str, make: Callable[[RecordDict, dict[str, Any]], Any]) -> Edit:
    return lambda content, ctx: with_records(content, **{name: make(content, ctx)})


def with_head(content: RecordDict, ctx: dict[str, Any]) -> RecordDict:
    """The uploaded arrays plus a head (`classifier.weight` of the mlp: 10 x 200)."""
    head = Array(np.zeros((10, 200), np.float32))
    return with_records(content, arrays=ArrayRecord({**dict(content["arrays"].items()), "classifier.weight": head}))


def extra_gradient_key(content: RecordDict, ctx: dict[str, Any]) -> ArrayRecord:
    grads = dict(content[GRADS].items())
    grads["²"] = next(iter(grads.values()))  # str.isdigit() is True, int() fails
    return ArrayRecord(grads)


def label_counts(edit: Callable[[np.ndarray], np.ndarray]) -> Edit:
    """FedGen's label counts replaced by `edit` of the honest ones."""
    return record(
        FEDGEN_COUNTS, lambda c, ctx: ArrayRecord({"counts": Array(edit(c[FEDGEN_COUNTS]["counts"].numpy()))})
    )


def negative_count(counts: np.ndarray) -> np.ndarray:
    """Class 0's count -1, class 1's raised so that the sum still equals num-examples."""
    out = counts.copy()
    out[1] += out[0] + 1
    out[0] = -1
    return out


def prototypes_with_counts(content: RecordDict, ctx: dict[str, Any], record: str = PROTO_RECORD) -> ArrayRecord:
    protos = content[record]["prototypes"].numpy().copy()
    counts = np.zeros(protos.shape[0], dtype=np.int64)
    counts[ctx["class"]] = ctx.get("count", 5)
    protos[ctx["class"]] = 3.0
    return ArrayRecord({"prototypes": torch.from_numpy(protos), "counts": torch.from_numpy(counts)})


def update_with(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[RecordDict, dict[str, Any]], ArrayRecord]:
    """FedDC's `feddc-update` record with `change` applied to a copy of its arrays."""

    def make(content: RecordDict, ctx: dict[str, Any]) -> ArrayRecord:
        arrays = {k: v.numpy().copy() for k, v in content[UPDATE].items()}
        change(arrays)
        return ArrayRecord({k: Array(v) for k, v in arrays.items()})

    return make


def first_entry(value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def change(arrays: dict[str, np.ndarray]) -> None:
        next(iter(arrays.values())).flat[0] = value

    return change


def prototype_arrays(content: RecordDict, record: str, **arrays: Any) -> ArrayRecord:
    """The reply's prototype record with some arrays replaced (numpy arrays)."""
    return ArrayRecord({**dict(content[record].items()), **{k: Array(v) for k, v in arrays.items()}})


def fedproto_counts(change: Callable[[np.ndarray], np.ndarray]) -> Edit:
    """FedProto's upload with its counts changed by `change` (prototypes kept)."""

    def edit(content: RecordDict, ctx: dict[str, Any]) -> RecordDict:
        counts = change(content[FEDPROTO]["counts"].numpy().copy())
        rec = ArrayRecord({"prototypes": content[FEDPROTO]["prototypes"], "counts": Array(counts)})
        return with_records(content, **{FEDPROTO: rec})

    return edit


def moved_count(counts: np.ndarray) -> np.ndarray:
    """The same total, one sample moved to another class: not the partition's counts."""
    src = int(np.flatnonzero(counts)[0])
    counts[src] -= 1
    counts[(src + 1) % len(counts)] += 1
    return counts


GENERIC: dict[str, Edit] = {
    "list-metric": metric(train_loss=[1.0, 2.0]),
    "list-num-examples": metric(num_examples=[100]),
    "undecodable-bytes": first_array_bytes(lambda shape: b"\x93NUMPY not an array"),
    "complex64-bytes": first_array_bytes(lambda shape: npy(np.ones(shape, np.complex64))),
    "int64-bytes": first_array_bytes(lambda shape: npy(np.ones(shape, np.int64))),
    "num-examples-2**62": metric(num_examples=2**62),
    "num-examples-0": metric(num_examples=0),
    # its weight in the pooled personalized accuracy: more test samples than its local split holds
    "personal-num-test-10**6": metric(personal_num_test=10**6),
    "other-partition": metric(partition_id=lambda ctx: ctx["other"]),
    "partition-10**12": metric(partition_id=10**12),
    "accuracy-1e9": metric(personal_accuracy=1e9),
    "inf-loss": metric(train_loss=float("inf")),
    "int-beyond-float": metric(train_seconds=10**400),
    "unknown-record": record("evil", lambda c, ctx: ArrayRecord({"x": torch.zeros(2)})),
    # finite but extreme: 3.4e38 weights average into a model every client trains to NaN
    "finite-extreme-model": first_array_bytes(lambda shape: npy(np.full(shape, 3.4e38, np.float32))),
    # within the value bound, but an update thousands of times the model's norm
    "huge-update": first_array_bytes(lambda shape: npy(np.full(shape, 1e5, np.float32))),
}
EVERY_METHOD = ("list-metric", "num-examples-2**62", "other-partition", "finite-extreme-model", "huge-update")


def extreme(name: str, key: str) -> Edit:
    """The record `name` with its array `key` replaced by finite 3.4e38 values (the rest kept)."""

    def edit(content: RecordDict, ctx: dict[str, Any]) -> RecordDict:
        arrays = dict(content[name].items())
        arrays[key] = Array(np.full(arrays[key].shape, 3.4e38, np.float32))
        return with_records(content, **{name: ArrayRecord(arrays)})

    return edit


SPECIFIC: dict[str, dict[str, Edit]] = {
    "map": {"list-hpm-participations": metric(hpm_participations=[1, 2])},
    "fedmr": {
        "list-intra-loss": metric(intra_loss=[0.5]),
        "prototypes-outside-sharing": record(PROTO_RECORD, prototypes_with_counts),
        "private-class-counts": record(PROTO_RECORD, lambda c, ctx: prototypes_with_counts(c, {"class": 0})),
        "extreme-prototypes": extreme(PROTO_RECORD, "prototypes"),
        "nan-prototypes": record(
            PROTO_RECORD,
            lambda c, ctx: ArrayRecord(
                {
                    "prototypes": Array(np.full(c[PROTO_RECORD]["prototypes"].shape, np.nan, np.float32)),
                    "counts": c[PROTO_RECORD]["counts"],
                }
            ),
        ),
    },
    "mupfl": {
        "gradient-key-²": record(GRADS, extra_gradient_key),
        "times-list": record(TIMES, lambda c, ctx: MetricRecord({"grads-seconds": [1.0, 2.0]})),
        "times-missing-key": record(TIMES, lambda c, ctx: MetricRecord({"other": 1.0})),
        "nan-gradient": record(
            GRADS,
            lambda c, ctx: ArrayRecord({k: Array(np.full(v.shape, np.nan, np.float32)) for k, v in c[GRADS].items()}),
        ),
        "map-wrong-size": record(MAPS, lambda c, ctx: ArrayRecord({"map": Array(np.zeros(3, np.float32))})),
        "extreme-map": extreme(MAPS, "map"),
        "extreme-gradient": lambda c, ctx: extreme(GRADS, next(iter(c[GRADS].keys())))(c, ctx),
        "list-start-accuracy": metric(start_accuracy=[0.5]),
        "times-without-real-norm": record(TIMES, lambda c, ctx: MetricRecord({"grads-seconds": 1.0})),
        "negative-real-norm": record(TIMES, lambda c, ctx: MetricRecord({"grads-seconds": 1.0, "real-norm": -1.0})),
        "dropped-mass-above-one": metric(bavd_dropped_mass=1.5),
    },
    "scaffold": {
        # a client that sends its own Delta c_i: undeclared (the server computes it)
        "control-uploaded": record(CONTROL, lambda c, ctx: ArrayRecord({"w": torch.ones(2)})),
    },
    "feddyn": {
        "list-gradient-norm": metric(feddyn_gradient_norm=[1.0]),
        "negative-gradient-norm": metric(feddyn_gradient_norm=-1.0),
    },
    "feddc": {
        "update-nan": record(UPDATE, update_with(first_entry(float("nan")))),
        "update-out-of-range": record(UPDATE, update_with(first_entry(3e6))),
        "update-huge": record(UPDATE, update_with(lambda a: a.update({k: v + 1e5 for k, v in a.items()}))),
        "update-wrong-shape": record(UPDATE, update_with(lambda a: a.update({next(iter(a)): np.zeros(3, np.float32)}))),
        "update-extra-array": record(UPDATE, update_with(lambda a: a.update({"evil": np.zeros(3, np.float32)}))),
        "update-missing": lambda c, ctx: RecordDict({k: v for k, v in c.items() if k != UPDATE}),
        "update-int64": record(UPDATE, update_with(lambda a: a.update({k: v.astype(np.int64) for k, v in a.items()}))),
    },
    "moon": {"list-moon-loss": metric(moon_loss=[0.5]), "moon-negative-2": metric(moon_negative=2)},
    "fedmmd": {"mmd-loss-minus-1": metric(mmd_loss=-1.0)},
    "fedproc": {
        "proto-alpha-2": metric(proto_alpha=2.0),
        "nan-prototypes": record(
            FEDPROC,
            lambda c, ctx: prototype_arrays(
                c, FEDPROC, prototypes=np.full(c[FEDPROC]["prototypes"].shape, np.nan, np.float32)
            ),
        ),
        "prototypes-wrong-shape": record(
            FEDPROC, lambda c, ctx: prototype_arrays(c, FEDPROC, prototypes=np.zeros((10, 3), np.float32))
        ),
        "negative-counts": record(
            FEDPROC, lambda c, ctx: prototype_arrays(c, FEDPROC, counts=np.full(10, -1, np.int64))
        ),
        "counts-beyond-num-examples": record(
            FEDPROC, lambda c, ctx: prototypes_with_counts(c, {"class": 1, "count": 10**9}, FEDPROC)
        ),
        "no-prototypes": lambda c, ctx: RecordDict({k: v for k, v in c.items() if k != FEDPROC}),
        "extreme-prototypes": extreme(FEDPROC, "prototypes"),
    },
    "fedaws": {"undecodable-bytes": GENERIC["undecodable-bytes"], "complex64-bytes": GENERIC["complex64-bytes"]},
    "fedgen": {
        "counts-sum-above-num-examples": label_counts(lambda n: n + 1),
        "counts-sum-below-num-examples": label_counts(lambda n: np.maximum(n - 1, 0)),
        "negative-count-same-sum": label_counts(negative_count),
        "counts-float64": label_counts(lambda n: n.astype(np.float64)),
        "counts-wrong-shape": label_counts(lambda n: n[:-1]),
        "counts-missing": lambda c, ctx: RecordDict({k: v for k, v in c.items() if k != FEDGEN_COUNTS}),
        "counts-extra-array": record(
            FEDGEN_COUNTS, lambda c, ctx: ArrayRecord({**dict(c[FEDGEN_COUNTS].items()), "x": Array(np.zeros(2))})
        ),
    },
    "creff": {
        "gradient-key-11": record(
            CREFF_GRADS,
            lambda c, ctx: ArrayRecord({**dict(c[CREFF_GRADS].items()), "11": next(iter(c[CREFF_GRADS].values()))}),
        ),
        "nan-gradient": record(
            CREFF_GRADS,
            lambda c, ctx: ArrayRecord(
                {k: Array(np.full(v.shape, np.nan, np.float32)) for k, v in c[CREFF_GRADS].items()}
            ),
        ),
        "gradient-wrong-shape": record(
            CREFF_GRADS,
            lambda c, ctx: ArrayRecord({k: Array(np.zeros((3, 3), np.float32)) for k in c[CREFF_GRADS].keys()}),
        ),
        "gradients-missing": lambda c, ctx: RecordDict({k: v for k, v in c.items() if k != CREFF_GRADS}),
        "extreme-gradient": lambda c, ctx: extreme(CREFF_GRADS, next(iter(c[CREFF_GRADS].keys())))(c, ctx),
    },
    "fedproto": {  # no model arrays: the model cases become prototype and model-less-upload cases
        "finite-extreme-model": extreme(FEDPROTO, "prototypes"),
        "huge-update": lambda c, ctx: with_records(
            c, arrays=ArrayRecord({"classifier.weight": Array(np.full((10, 200), 1e5, np.float32))})
        ),
        "model-array-uploaded": lambda c, ctx: with_records(
            c, arrays=ArrayRecord({"classifier.weight": Array(np.zeros((10, 200), np.float32))})
        ),
        "nan-prototypes": record(
            FEDPROTO,
            lambda c, ctx: ArrayRecord(
                {
                    "prototypes": Array(np.full(c[FEDPROTO]["prototypes"].shape, np.nan, np.float32)),
                    "counts": c[FEDPROTO]["counts"],
                }
            ),
        ),
        "counts-not-the-partitions": fedproto_counts(moved_count),
        "negative-counts": fedproto_counts(lambda n: np.where(np.arange(len(n)) == 0, -1, n)),
        "prototype-inference-2": metric(prototype_inference=2),
    },
    "fedphp": {
        "hpm-mu-above-one": metric(hpm_mu=1.5),
        "list-hpm-participations": metric(hpm_participations=[1, 2]),
    },
    "ditto": {
        "list-ditto-distance": metric(ditto_distance=[1.0]),
        "negative-ditto-distance": metric(ditto_distance=-1.0),
        "nan-ditto-loss": metric(ditto_loss=float("nan")),
    },
    "fedrep": {"head-uploaded": with_head, "negative-head-loss": metric(fedrep_head_loss=-0.5)},
    "fedbabu": {"head-uploaded": with_head, "inf-finetune-loss": metric(fedbabu_finetune_loss=float("inf"))},
    "fedrod": {
        "personal-head-uploaded": record(
            "fedrod-personal-head", lambda c, ctx: ArrayRecord({"weight": torch.zeros(10, 200)})
        ),
        "negative-bsm-loss": metric(fedrod_bsm_loss=-1.0),
        "list-personal-loss": metric(fedrod_personal_loss=[0.1]),
    },
    "fedgela": {
        "classifier-uploaded": lambda c, ctx: with_records(
            c,
            arrays=ArrayRecord(
                {**dict(c["arrays"].items()), "classifier.weight": Array(np.zeros((10, 84), np.float32))}
            ),
        ),
    },
}
CASES = (
    [(m, k) for m in METHODS for k in EVERY_METHOD]
    + [("fedavg", k) for k in GENERIC if k not in EVERY_METHOD]
    + [(m, k) for m, kinds in SPECIFIC.items() for k in kinds if k not in EVERY_METHOD]
)


def edit_for(method: str, kind: str) -> Edit:
    return SPECIFIC.get(method, {}).get(kind) or GENERIC[kind]


# ---------------------------------------------------------------------------------------------- one round
def method_config(method: str, **extra: Any) -> dict[str, Any]:
    return {**app_defaults(), **COMMON, "method": method, **METHODS[method], **extra}


@pytest.fixture(scope="module")
def honest_round():
    """method -> (strategy before aggregation, {node: request}, {node: honest reply content})."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    cache: dict[str, tuple] = {}

    def make(method: str):
        if method not in cache:
            cfg = method_config(method)
            grid = InProcessGrid(NODES, cfg, num_partitions=PARTITIONS)
            strategy = get_method(method).strategy_class()(validate(cfg))
            requests = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord({"attempt": 0}), grid))
            replies = grid.send_and_receive(requests)
            assert all(not r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
            cache[method] = (
                strategy,
                {m.metadata.dst_node_id: m for m in requests},
                {r.metadata.src_node_id: r.content for r in replies},
            )
        return cache[method]

    return make


def hostile_node(strategy, nodes: list[int], kind: str) -> int:
    if kind == "prototypes-outside-sharing":  # a node outside FedMR's sharing subset
        share = strategy.share_mask()
        return next(n for n in nodes if not share[strategy.node_partitions[n]])
    return nodes[1]


@pytest.mark.parametrize(("method", "kind"), CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_a_hostile_reply_is_a_counted_failure_and_changes_nothing(honest_round, method: str, kind: str) -> None:
    strategy, requests, contents = honest_round(method)
    nodes = sorted(requests)
    bad = hostile_node(strategy, nodes, kind)
    ctx = {"other": strategy.node_partitions[next(n for n in nodes if n != bad)], "class": 1}
    with_hostile, honest_only = copy.deepcopy(strategy), copy.deepcopy(strategy)

    def replies(include_hostile: bool) -> list[Message]:
        out = []
        for n in nodes:
            if n != bad:
                out.append(Message(RecordDict(dict(contents[n].items())), reply_to=requests[n]))
            elif include_hostile:
                out.append(Message(edit_for(method, kind)(contents[n], ctx), reply_to=requests[n]))
        return out

    got, got_metrics = with_hostile.aggregate_train(1, replies(True))
    want, want_metrics = honest_only.aggregate_train(1, replies(False))
    assert [(f["node"], f["partition"]) for f in with_hostile.failures] == [(bad, strategy.node_partitions[bad])]
    assert "no reply" not in with_hostile.failures[0]["reason"]
    assert list(got.keys()) == list(want.keys())
    for k in want.keys():
        a, b = got[k].numpy(), want[k].numpy()
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    drop = lambda m: {k: v for k, v in m.items() if "seconds" not in k}  # noqa: E731
    assert json.dumps(drop(got_metrics), default=str) == json.dumps(drop(want_metrics), default=str)
    sa, sb = with_hostile.state_dict(), honest_only.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_reply_with_zero_examples_is_a_failure_not_a_crash(honest_round) -> None:
    strategy, requests, contents = honest_round("fedavg")
    strategy = copy.deepcopy(strategy)
    replies = [Message(metric(num_examples=0)(contents[n], {}), reply_to=r) for n, r in requests.items()]
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is None and metrics["failures"] == NODES and metrics["replies"] == 0


# ---------------------------------------------------------------------------------------------- discovery
class InfoGrid:
    """Answers `query.info` with a given ConfigRecord content per node (None: no 'info' record)."""

    def __init__(self, infos: dict[int, dict | None]) -> None:
        self.infos = infos
        self.asked: list[int] = []

    def get_node_ids(self) -> list[int]:
        return list(self.infos)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for m in messages:
            self.asked.append(m.metadata.dst_node_id)
            info = self.infos[m.metadata.dst_node_id]
            content = RecordDict() if info is None else RecordDict({"info": ConfigRecord(info)})
            out.append(Message(content, reply_to=m))
        return out


HONEST = {n: {"partition-id": n - 1, "num-partitions": 10} for n in (1, 2, 3)}


def fedmr_strategy(**cfg: Any):
    return get_method("fedmr").strategy_class()(validate({"method": "fedmr", "partition": "iid", **cfg}))


@pytest.mark.parametrize("counted", [0, 10], ids=["count-from-majority", "count-from-config"])
@pytest.mark.parametrize(
    "info",
    [
        None,
        {"num-partitions": 10},
        {"partition-id": "abc", "num-partitions": 10},
        {"partition-id": 1.5, "num-partitions": 10},
        {"partition-id": True, "num-partitions": 10},
        {"partition-id": 5},
        {"partition-id": 5, "num-partitions": 3e9},
        {"partition-id": 5, "num-partitions": 3_000_000_000},
        {"partition-id": 5, "num-partitions": 12},  # not the run's count
        {"partition-id": 1, "num-partitions": 2},  # not the run's count, and it says so first
        {"partition-id": 10, "num-partitions": 10},
        {"partition-id": -1, "num-partitions": 10},
    ],
    ids=lambda i: "no-info" if i is None else ",".join(f"{k}={v}" for k, v in i.items()),
)
def test_discovery_refuses_a_bad_node_report(task_identity, info: dict | None, counted: int) -> None:
    """Whether it answers first or last, a bad report serves nothing and the honest nodes serve
    theirs; its refusal is counted with the next round's failures, and it is asked again."""
    for order in ({9: info, **HONEST}, {**HONEST, 9: info}):
        strategy = fedmr_strategy(**{"num-partitions": counted})
        nodes = strategy.discover(InfoGrid(order))
        assert nodes == {1: 0, 2: 1, 3: 2} and strategy.num_partitions == 10
        assert strategy.share_mask().shape == (10,)
        grid = InfoGrid(order)
        assert strategy.discover(grid) == nodes and grid.asked == [9]  # refused nodes are asked again
        strategy.sent_messages = []
        strategy.aggregate_train(1, [])
        assert [(f["node"], f["partition"]) for f in strategy.failures] == [(9, -1)]  # once, however often asked
        assert "refused" in strategy.failures[0]["reason"]


def test_a_contested_partition_is_served_by_no_claimant_until_one_leaves(task_identity) -> None:
    """A node claiming partition 0, which node 1 serves, takes it from nobody and gives it to nobody
    (whichever answered first); once it leaves, node 1 serves partition 0 again."""
    liar = {"partition-id": 0, "num-partitions": 10}
    for order in ({9: liar, **HONEST}, {**HONEST, 9: liar}):
        strategy = fedmr_strategy()
        assert strategy.discover(InfoGrid(order)) == {2: 1, 3: 2}
        assert "contested" in strategy.refused[1] and "contested" in strategy.refused[9]
        assert strategy.discover(InfoGrid(HONEST)) == {1: 0, 2: 1, 3: 2}
    strategy = fedmr_strategy()
    assert strategy.discover(InfoGrid(HONEST)) == {1: 0, 2: 1, 3: 2}  # served first, contested later
    assert strategy.discover(InfoGrid({**HONEST, 9: liar})) == {2: 1, 3: 2}


def test_without_a_configured_count_only_a_strict_majority_of_nodes_sets_it(task_identity) -> None:
    """No count in the run config: a count more than half of the nodes report, never the first one."""
    strategy = fedmr_strategy()
    lone = {9: {"partition-id": 0, "num-partitions": 2}}
    assert strategy.discover(InfoGrid(lone)) == {9: 0}  # alone, it is the majority: set num-partitions
    strategy = fedmr_strategy()
    tie = {9: {"partition-id": 0, "num-partitions": 2}, 1: HONEST[1]}
    assert strategy.discover(InfoGrid(tie)) == {} and strategy.num_partitions is None
    assert strategy.discover(InfoGrid({**tie, **HONEST})) == {1: 0, 2: 1, 3: 2}  # the refusal was not for good
    assert strategy.num_partitions == 10


def test_an_operator_binds_a_contested_partition_to_its_node(task_identity, caplog) -> None:
    """A liar claiming partition 0 blocks node 1 whichever answers first, and both refusals name the
    other node and the way out; with `partition-bindings` "1:0" node 1 serves partition 0 again, the
    liar is refused naming the binding, and a bound node claiming another partition serves nothing.
    Nothing favours whoever answered first."""
    liar = {"partition-id": 0, "num-partitions": 10}
    with caplog.at_level("WARNING", logger="fedskew.server"):
        strategy = fedmr_strategy()
        assert strategy.discover(InfoGrid({9: liar, **HONEST})) == {2: 1, 3: 2}
    for node, other in ((1, 9), (9, 1)):
        assert (
            f"also claimed by node {other}" in strategy.refused[node]
            and "partition-bindings=" in strategy.refused[node]
        )
    assert "node 1 refused" in caplog.text and "node 9 refused" in caplog.text
    for order in ({9: liar, **HONEST}, {**HONEST, 9: liar}):
        strategy = fedmr_strategy(**{"partition-bindings": "1:0"})
        assert strategy.discover(InfoGrid(order)) == {1: 0, 2: 1, 3: 2}
        assert strategy.refused[9] == "partition 0 is bound to node 1 (partition-bindings)"
    strategy = fedmr_strategy(**{"partition-bindings": "9:5, 1:0"})  # 9 is bound to 5 but claims 0
    assert strategy.discover(InfoGrid({9: liar, **HONEST})) == {1: 0, 2: 1, 3: 2}
    assert "binds it to partition 5" in strategy.refused[9]
    strategy = fedmr_strategy(**{"partition-bindings": "1:0"})  # node 1 gone: partition 0 waits for it
    assert strategy.discover(InfoGrid({9: liar, 2: HONEST[2]})) == {2: 1}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("1=0", "'1=0' is not NODE:PARTITION"),
        ("1:0,2:0", "bound twice"),
        ("1:0,1:2", "bound twice"),
        ("-1:0", "is not NODE:PARTITION"),
        (f"{2**64}:0", "is not a Flower node id"),
        ("1:10", "partition 10 is not one of the num-partitions=10"),
    ],
)
def test_a_malformed_partition_binding_is_refused_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as refused:
        validate({"partition-bindings": text, "num-partitions": 10})
    assert str(refused.value).startswith(f"partition-bindings={text!r} is not allowed: ") and needle in str(
        refused.value
    )


# ---------------------------------------------------------------------------------------------- end to end
E2E: dict[str, list[str]] = {
    "fedavg": list(GENERIC),
    "fedmr": ["list-metric", "finite-extreme-model", *SPECIFIC["fedmr"]],
    "mupfl": ["num-examples-2**62", "finite-extreme-model", *SPECIFIC["mupfl"]],
    "map": ["other-partition", "finite-extreme-model", *SPECIFIC["map"]],
    "fedgela": ["complex64-bytes", "finite-extreme-model", *SPECIFIC["fedgela"]],
    "feddc": ["num-examples-2**62", "finite-extreme-model", *SPECIFIC["feddc"]],
    "fedproc": ["other-partition", "finite-extreme-model", *SPECIFIC["fedproc"]],
    "fedproto": ["other-partition", "model-array-uploaded", "nan-prototypes", "counts-not-the-partitions"],
    "fedphp": ["list-metric", "finite-extreme-model", *SPECIFIC["fedphp"]],
    "fedrep": ["other-partition", "finite-extreme-model", *SPECIFIC["fedrep"]],
}


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("method", list(E2E))
def test_one_hostile_client_among_honest_ones_changes_nothing(tmp_path, task_identity, method: str) -> None:
    """The real ServerApp: a hostile client sends one bad payload kind per round; every round
    completes, names it in failures.jsonl, and the run equals one in which it sent nothing."""
    kinds = E2E[method]
    bad = 1
    if method == "fedmr":  # outside the sharing subset, so that its prototypes must be refused
        strategy = get_method("fedmr").strategy_class()(validate(method_config("fedmr")))
        strategy.num_partitions = PARTITIONS
        bad = int(np.flatnonzero(~strategy.share_mask()[:NODES])[0])
    ctx = {"other": (bad + 1) % NODES, "class": 1}
    cfg = {**COMMON, "method": method, **METHODS[method], "num-server-rounds": len(kinds), "out-dir": str(tmp_path)}

    def hostile(kind: str):
        return lambda msg, reply: Message(edit_for(method, kind)(reply.content, ctx), reply_to=msg)

    silent = {(bad, r): (lambda msg, reply: None) for r in range(1, len(kinds) + 1)}
    faults = {(bad, r): hostile(kind) for r, kind in enumerate(kinds, start=1)}
    run_in_process({**cfg, "run-name": "hostile"}, NODES, faults, PARTITIONS)
    run_in_process({**cfg, "run-name": "silent"}, NODES, silent, PARTITIONS)
    a, b = tmp_path / "hostile", tmp_path / "silent"
    assert len(rows(a / "metrics.jsonl")) == len(kinds) and (a / "summary.json").is_file()
    lost = rows(a / "failures.jsonl")
    assert [(f["round"], f["partition"]) for f in lost] == [(r, bad) for r in range(1, len(kinds) + 1)]
    assert not any("no reply" in f["reason"] for f in lost)
    assert (a / "metrics.jsonl").read_text() == (b / "metrics.jsonl").read_text()
    assert same_model(a, b)


def without_failure_counts(path) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "failures"} for row in rows(path)]


def same_model(a, b) -> bool:
    """The two runs end with the same global model, or, for a method without one (FedProto: no
    `model.pt`), the same strategy state in their final checkpoints (the global prototypes)."""
    if not (a / "model.pt").exists() and not (b / "model.pt").exists():
        ma = torch.load(a / "checkpoint.pt", weights_only=True)["strategy"]
        mb = torch.load(b / "checkpoint.pt", weights_only=True)["strategy"]
    else:
        ma, mb = torch.load(a / "model.pt", weights_only=True), torch.load(b / "model.pt", weights_only=True)
    return ma.keys() == mb.keys() and all(ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize("counted", [0, PARTITIONS], ids=["count-from-majority", "count-from-config"])
@pytest.mark.parametrize("method", list(METHODS))
def test_a_node_that_races_to_report_another_count_changes_nothing(tmp_path, task_identity, method, counted) -> None:
    """The real ServerApp: a node that answers discovery first with num-partitions=2 (the honest nodes
    serve partitions of 50) serves nothing, its refusal is logged, and the run equals the honest-only run."""
    cfg = {**COMMON, "method": method, **METHODS[method], "out-dir": str(tmp_path), "num-partitions": counted}
    liar = {1: {"partition-id": 0, "num-partitions": 2}}
    run_in_process({**cfg, "run-name": "race"}, NODES, num_partitions=PARTITIONS, extra_nodes=liar)
    grid = run_in_process({**cfg, "run-name": "honest"}, NODES, num_partitions=PARTITIONS)
    race, honest = tmp_path / "race", tmp_path / "honest"
    assert without_failure_counts(race / "metrics.jsonl") == without_failure_counts(honest / "metrics.jsonl")
    assert same_model(race, honest)
    # a method declares the client state it keeps (a suite does not resume its runs): it keeps some
    # after its first round exactly when it says so (the participation count is every method's)
    kept = {k for ctx in grid.contexts.values() for k in ctx.state.keys()} - {f"values.{PARTICIPATION}"}
    assert bool(kept) == bool(get_method(method).resume_note(validate({**app_defaults(), **cfg}))), kept
    lost = rows(race / "failures.jsonl")
    assert [(f["round"], f["node"]) for f in lost] == [(1, 1)] and "num-partitions=2" in lost[0]["reason"]


def test_a_node_claiming_a_served_partition_takes_it_from_nobody(tmp_path, task_identity) -> None:
    """A node that answers first claiming partition 0 contests it: neither it nor the honest node of
    partition 0 trains, and the run equals one without partition 0's node."""
    cfg = {**COMMON, "method": "fedavg", "out-dir": str(tmp_path), "num-partitions": PARTITIONS}
    liar = {1: {"partition-id": 0, "num-partitions": PARTITIONS}}
    run_in_process({**cfg, "run-name": "race"}, NODES, num_partitions=PARTITIONS, extra_nodes=liar)
    run_in_process({**cfg, "run-name": "honest"}, NODES, num_partitions=PARTITIONS)
    race = tmp_path / "race"
    assert [(f["node"], "contested" in f["reason"]) for f in rows(race / "failures.jsonl")] == [(1, True), (1000, True)]
    assert not same_model(race, tmp_path / "honest")  # partition 0's node trained there, not here
    absent = {1000 + 17 * i: {"partition-id": i + 1, "num-partitions": PARTITIONS} for i in range(NODES - 1)}
    run_in_process({**cfg, "run-name": "absent"}, 0, num_partitions=PARTITIONS, extra_nodes=absent)
    assert same_model(race, tmp_path / "absent")


# ---------------------------------------------------------------------------------------------- server -> client
def nan_like(rec: ArrayRecord, key: str) -> ArrayRecord:
    arrays = dict(rec.items())
    arrays[key] = Array(np.full(rec[key].numpy().shape, np.nan, np.float32))
    return ArrayRecord(arrays)


def nan_etf(content: RecordDict) -> RecordDict:
    """A NaN ETF with the checksum of its own bytes (the checksum comes from the same sender)."""
    from fedskew.losses.fedgela import etf_checksum

    etf = torch.full(tuple(content["etf"]["etf"].shape), float("nan"))
    return with_records(content, etf=ArrayRecord({"etf": etf}), etf_info=ConfigRecord({"sha256": etf_checksum(etf)}))


def etf_with_checksum(content: RecordDict, make: Callable[..., torch.Tensor]) -> RecordDict:
    """Another ETF (`make(shape)`) with the checksum of its own bytes: a checksum proves nothing."""
    from fedskew.losses.fedgela import etf_checksum

    etf = make(tuple(content["etf"]["etf"].shape))
    return with_records(content, etf=ArrayRecord({"etf": etf}), etf_info=ConfigRecord({"sha256": etf_checksum(etf)}))


NAME = "classifier.weight"  # a trainable parameter of every network

SERVER_PAYLOADS: dict[str, tuple[str, dict[str, Any], Callable[[RecordDict], RecordDict]]] = {
    "fedmr-nan-prototypes": (
        "fedmr",
        {},
        lambda c: with_records(c, **{PROTO_RECORD: nan_like(c[PROTO_RECORD], "prototypes")}),
    ),
    "mupfl-nan-features": (
        "mupfl",
        {},
        lambda c: with_records(c, **{"mupfl-features": nan_like(c["mupfl-features"], "features")}),
    ),
    "mupfl-labels-out-of-range": (
        "mupfl",
        {},
        lambda c: with_records(
            c,
            **{
                "mupfl-features": ArrayRecord(
                    {
                        **dict(c["mupfl-features"].items()),
                        "labels": Array(np.full(c["mupfl-features"]["labels"].shape, 99)),
                    }
                )
            },
        ),
    ),
    "fedgela-nan-etf": ("fedgela", {}, nan_etf),
    "fedgela-zero-etf-with-its-checksum": ("fedgela", {}, lambda c: etf_with_checksum(c, torch.zeros)),
    "fedavg-extreme-model": ("fedavg", {}, lambda c: extreme("arrays", next(iter(c["arrays"].keys())))(c, {})),
    "fedmr-extreme-prototypes": ("fedmr", {}, lambda c: extreme(PROTO_RECORD, "prototypes")(c, {})),
    "fedmr-share-mask-text": ("fedmr", {}, lambda c: with_records(c, fedmr_config=ConfigRecord({"share-mask": "yes"}))),
    "mupfl-extreme-features": ("mupfl", {}, lambda c: extreme("mupfl-features", "features")(c, {})),
    "mupfl-features-and-labels-differ": (
        "mupfl",
        {},
        lambda c: with_records(
            c, mupfl_features=ArrayRecord({**dict(c["mupfl-features"].items()), "labels": Array(np.zeros(3, np.int64))})
        ),
    ),
    **{
        f"server-round-{name}": (
            "fedavg",
            {},
            lambda c, v=value: with_records(c, config=ConfigRecord({"server-round": v})),
        )
        for name, value in (("text", "7"), ("float", 1.9), ("bool", True), ("0", 0), ("2**62", 2**62))
    },
    "scaffold-nan-control": ("scaffold", {}, lambda c: with_records(c, control=nan_like(c[CONTROL], NAME))),
    "scaffold-extreme-control": ("scaffold", {}, lambda c: extreme(CONTROL, NAME)(c, {})),
    "scaffold-control-missing": ("scaffold", {}, lambda c: RecordDict({k: v for k, v in c.items() if k != CONTROL})),
    "feddc-control-wrong-shape": (
        "feddc",
        {},
        lambda c: with_records(
            c, control=ArrayRecord({**dict(c[CONTROL].items()), NAME: Array(np.zeros(3, np.float32))})
        ),
    ),
    "fedproc-nan-prototypes": (
        "fedproc",
        {},
        lambda c: with_records(c, **{FEDPROC: nan_like(c[FEDPROC], "prototypes")}),
    ),
    "fedproc-valid-not-bool": (
        "fedproc",
        {},
        lambda c: with_records(
            c, **{FEDPROC: ArrayRecord({**dict(c[FEDPROC].items()), "valid": Array(np.ones(10, np.float32))})}
        ),
    ),
    "fedproc-extreme-prototypes": ("fedproc", {}, lambda c: extreme(FEDPROC, "prototypes")(c, {})),
    "fedgen-nan-generator": (
        "fedgen",
        {},
        lambda c: with_records(c, **{FEDGEN_GENERATOR: nan_like(c[FEDGEN_GENERATOR], "representation.weight")}),
    ),
    "fedgen-generator-missing-array": (
        "fedgen",
        {},
        lambda c: with_records(
            c,
            **{FEDGEN_GENERATOR: ArrayRecord({k: v for k, v in c[FEDGEN_GENERATOR].items() if "running" not in k})},
        ),
    ),
    "creff-nan-classifier": (
        "creff",
        {},
        lambda c: with_records(c, **{CREFF_CLASSIFIER: nan_like(c[CREFF_CLASSIFIER], "weight")}),
    ),
    "creff-classifier-1e9": (
        "creff",
        {},
        lambda c: with_records(c, **{CREFF_CLASSIFIER: ArrayRecord({"weight": torch.full((10, 200), 1e9)})}),
    ),
    "creff-classifier-missing": (
        "creff",
        {},
        lambda c: RecordDict({k: v for k, v in c.items() if k != CREFF_CLASSIFIER}),
    ),
    "fedproto-nan-prototypes": (
        "fedproto",
        {},
        lambda c: with_records(c, **{FEDPROTO: nan_like(c[FEDPROTO], "prototypes")}),
    ),
    "fedproto-extreme-prototypes": ("fedproto", {}, lambda c: extreme(FEDPROTO, "prototypes")(c, {})),
    "fedproto-model-arrays": (
        "fedproto",
        {},
        lambda c: with_records(c, arrays=ArrayRecord({"classifier.weight": torch.zeros(10, 200)})),
    ),
    "fedrep-head-sent": ("fedrep", {}, lambda c: with_head(c, {})),
    "fedrep-body-incomplete": (
        "fedrep",
        {},
        lambda c: with_records(c, arrays=ArrayRecord(dict(list(c["arrays"].items())[1:]))),
    ),
    "fedbabu-nan-head": ("fedbabu", {}, lambda c: with_records(c, arrays=nan_like(c["arrays"], "classifier.weight"))),
    "undeclared-record": ("fedavg", {}, lambda c: with_records(c, evil=ArrayRecord({"x": torch.zeros(2)}))),
}


@pytest.mark.parametrize("case", list(SERVER_PAYLOADS))
def test_a_client_refuses_a_bad_server_payload_before_training(monkeypatch, task_identity, case: str) -> None:
    """The trainer checks every server record (model arrays and extras) before it trains."""
    from fedskew.client_app import base as trainer_base
    from fedskew.client_app.app import train

    method, extra, edit = SERVER_PAYLOADS[case]
    cfg = method_config(method, **extra)
    grid = InProcessGrid(1, cfg, num_partitions=PARTITIONS)
    strategy = get_method(method).strategy_class()(validate(cfg))
    if method == "mupfl":  # synthetic features exist from round 2 on
        strategy.features = torch.zeros(10, cfg["mupfl-features-per-class"], strategy.feature_dim)
        strategy.seen = {1, 2}
    if method == "fedgen":  # the generator is sent once it has been trained
        strategy.rounds = 1
    (msg,) = strategy.configure_train(2, strategy.initial_arrays(), ConfigRecord({"attempt": 0}), grid)
    msg.content = edit(msg.content)

    def no_training(*a, **k):
        raise AssertionError("the client trained on a bad server payload")

    monkeypatch.setattr(trainer_base, "train_steps", no_training)
    with pytest.raises(ValueError):
        train(msg, grid.contexts[msg.metadata.dst_node_id])
