"""What crosses the network for each method, declared once: both sides import it from here.

Every train message carries the model (`arrays`), the round's `config` and the method's downlink
records; every reply carries the uploaded `arrays`, the `metrics` (`CLIENT_METRICS` plus the
method's own) and the method's uplink records. A method's `Wire` declares its metrics, its uplink
and its downlink, as functions of `Dims` (the run config and the shapes of the method's plain
network), so that the server's base strategy screens replies and the client's base trainer checks
server messages against one declaration (`fedskew.records.check_content`).

Bounds shared by every method: a floating array in either direction holds no value beyond
+-`fedskew.records.VALUE_BOUND` unless its form declares a range; `server-round` is an integer in
[1, num-server-rounds] and `attempt` in [0, round-retries].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedskew.records import (
    FRACTION,
    NON_NEGATIVE,
    ArraysSpec,
    ConfigSpec,
    Flags,
    MetricsSpec,
    Number,
    Spec,
    Tensor,
    Text,
)

if TYPE_CHECKING:
    from fedskew.data import DatasetInfo

MODEL = "arrays"
CONFIG = "config"
METRICS = "metrics"

# What every client reports (`fedskew.client_app.base`); num-examples is bounded above by the size of
# the reply's partition (`BaseStrategy.check_reply`).
CLIENT_METRICS: dict[str, Number] = {
    "num-examples": Number(int, 1, required=True),
    "partition-id": Number(int, 0, required=True),
    "personal-num-test": Number(int, 0),
    "personal-accuracy": FRACTION,
    "personal-loss": NON_NEGATIVE,
    "client-global-accuracy": FRACTION,
    "client-global-loss": NON_NEGATIVE,
    "train-loss": NON_NEGATIVE,
    "train-steps": NON_NEGATIVE,
    "train-seconds": NON_NEGATIVE,
    "participations": Number(int, 0),
}


@dataclass(frozen=True)
class Dims:
    """What record shapes depend on: the validated run config and the method's plain network
    (`fedskew.models.build_model` of the configured model and data set)."""

    cfg: Mapping[str, Any]
    info: DatasetInfo
    num_classes: int
    feature_dim: int
    model: Mapping[str, Tensor]  # the plain network's state dict, name -> form

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> Dims:
        from fedskew.data import dataset_info

        info = dataset_info(dict(cfg))
        classes, features, forms = _network(cfg["model"], info)
        return cls(cfg, info, classes, features, dict(forms))


@functools.lru_cache(maxsize=8)
def _network(model: str, info: DatasetInfo) -> tuple[int, int, tuple[tuple[str, Tensor], ...]]:
    """(classes, feature dimension, state-dict forms) of the network `model` for data `info`,
    built once per process (a client builds its trainer every round)."""
    from fedskew.models import build_model
    from fedskew.records import tensor_like

    net = build_model(model, info)
    forms = tuple((k, tensor_like(v)) for k, v in net.state_dict().items())
    return net.num_classes, net.feature_dim, forms


Records = Callable[[Dims], dict[str, Spec]]


def no_records(dims: Dims) -> dict[str, Spec]:
    return {}


@dataclass(frozen=True)
class Wire:
    """A method's records beyond the model arrays, the round config and `CLIENT_METRICS`."""

    metrics: Mapping[str, Number] = field(default_factory=dict)
    uplink: Records = no_records
    downlink: Records = no_records

    def extend(
        self,
        metrics: Mapping[str, Number] | None = None,
        uplink: Records | None = None,
        downlink: Records | None = None,
    ) -> Wire:
        """This wire plus more metrics and records (a method built on another's: MAP on FedRS)."""

        def both(a: Records, b: Records | None) -> Records:
            return a if b is None else (lambda dims: {**a(dims), **b(dims)})

        return Wire({**self.metrics, **(metrics or {})}, both(self.uplink, uplink), both(self.downlink, downlink))

    def reply_schema(self, dims: Dims, upload: Mapping[str, Tensor]) -> dict[str, Spec]:
        """Every record of a reply whose uploaded arrays have the forms `upload`."""
        return {
            MODEL: ArraysSpec(dict(upload)),
            METRICS: MetricsSpec({**CLIENT_METRICS, **self.metrics}),
            **self.uplink(dims),
        }

    def downlink_schema(self, dims: Dims) -> dict[str, Spec]:
        """Every record of a train message but the model arrays (checked against the model the
        client builds, `fedskew.client_app.base.checked_arrays`): the round config and the
        method's downlink records."""
        return {CONFIG: round_config(dims.cfg), **self.downlink(dims)}


def round_config(cfg: Mapping[str, Any]) -> ConfigSpec:
    """The `config` record of a train message: the round and the attempt."""
    return ConfigSpec(
        {
            "server-round": Number(int, 1, cfg["num-server-rounds"], required=True),
            "attempt": Number(int, 0, cfg["round-retries"]),
        }
    )


BASE = Wire()

# ---------------------------------------------------------------------------------------- FedRS
FEDRS = Wire({"observed-classes": NON_NEGATIVE})

# ---------------------------------------------------------------------------------------- HPM
# The inherited private model's schedule, reported by FedPHP and MAP: the momentum of this
# participation and the participation's number (the server counts them too, `strategies/hpm.py`).
HPM_METRICS: dict[str, Number] = {"hpm-mu": FRACTION, "hpm-participations": Number(int, 1)}

FEDPHP = Wire(HPM_METRICS)

# ---------------------------------------------------------------------------------------- MAP
MAP = FEDRS.extend(
    {
        "stage2-loss": Number(float, 0.0, nan=True),  # NaN: no stage 2 (map-personal-epochs=0)
        "stage2-accuracy": Number(float, 0.0, 1.0, nan=True),  # NaN: no local test data
        **HPM_METRICS,
        "hpm-transfer": Number(int, 0, 1),
    }
)

# ---------------------------------------------------------------------------------------- prototypes
# FedMR and FedProto exchange class prototypes in the same two records: a client uploads its
# per-class mean features and the class counts behind them (zero rows for classes it does not hold),
# the server sends the global prototypes and which classes have one.


def local_prototypes(dims: Dims) -> ArraysSpec:
    """{prototypes [C, d] float32, counts [C] int64 >= 0}: a client's upload."""
    c, d = dims.num_classes, dims.feature_dim
    return ArraysSpec({"prototypes": Tensor((c, d), "float32"), "counts": Tensor((c,), "int64", low=0)})


def global_prototypes(dims: Dims, required: bool = True) -> ArraysSpec:
    """{prototypes [C, d] float32, valid [C] bool}: what the server sends."""
    c, d = dims.num_classes, dims.feature_dim
    protos = {"prototypes": Tensor((c, d), "float32"), "valid": Tensor((c,), "bool")}
    return ArraysSpec(protos, required=required)


# ---------------------------------------------------------------------------------------- FedMR
FEDMR_PROTOTYPES = "fedmr-prototypes"
FEDMR_CONFIG = "fedmr-config"
MAX_PARTITIONS = 1_000_000  # the longest per-partition list a message may carry


def _fedmr_uplink(dims: Dims) -> dict[str, Spec]:
    return {FEDMR_PROTOTYPES: local_prototypes(dims)}


def _fedmr_downlink(dims: Dims) -> dict[str, Spec]:
    return {
        FEDMR_PROTOTYPES: global_prototypes(dims, required=False),
        FEDMR_CONFIG: ConfigSpec({"share-mask": Flags(MAX_PARTITIONS, required=True)}, required=False),
    }


FEDMR = Wire(
    {"intra-loss": NON_NEGATIVE, "inter-loss": NON_NEGATIVE, "inter-active": FRACTION, "prototypes-shared": FRACTION},
    _fedmr_uplink,
    _fedmr_downlink,
)

# ---------------------------------------------------------------------------------------- FedProto
# Only prototypes travel: the uploaded and the sent model `arrays` are empty ArrayRecords (the
# screen refuses any array in them), the prototypes go both ways in `fedproto-prototypes`.
FEDPROTO_PROTOTYPES = "fedproto-prototypes"

FEDPROTO = Wire(
    {"proto-loss": NON_NEGATIVE, "prototype-inference": Number(int, 0, 1)},
    lambda dims: {FEDPROTO_PROTOTYPES: local_prototypes(dims)},
    lambda dims: {FEDPROTO_PROTOTYPES: global_prototypes(dims)},
)

# ---------------------------------------------------------------------------------------- FedGELA
FEDGELA_ETF = "etf"
FEDGELA_ETF_INFO = "etf-info"


def _fedgela_downlink(dims: Dims) -> dict[str, Spec]:
    etf = Tensor((dims.feature_dim, dims.num_classes), "float32", -1.0, 1.0)  # unit-norm columns
    info = {"sha256": Text(64, "0123456789abcdef", required=True), "seed": Number(int, 0)}
    return {FEDGELA_ETF: ArraysSpec({"etf": etf}), FEDGELA_ETF_INFO: ConfigSpec(info)}


FEDGELA = Wire(downlink=_fedgela_downlink)

# ---------------------------------------------------------------------------------------- MuPFL
MUPFL_FEATURES = "mupfl-features"
MUPFL_MAPS = "mupfl-map"
MUPFL_GRADS = "mupfl-grads"
MUPFL_CLASSIFIER = "mupfl-classifier"
MUPFL_GLOBAL = "mupfl-global"
MUPFL_TIMES = "mupfl-times"


def _mupfl_uplink(dims: Dims) -> dict[str, Spec]:
    """The flattened BAVD maps (BAVD on and layers to hook) and, with PKCF, one classifier gradient
    per class the client holds and its timing."""
    from fedskew.losses.mupfl import bavd_map_size
    from fedskew.models import build_model

    cfg, records = dims.cfg, {}
    size = bavd_map_size(build_model(cfg["model"], dims.info), dims.info) if cfg["mupfl-bavd"] else 0
    if size:
        records[MUPFL_MAPS] = ArraysSpec({"map": Tensor((size,), "float32")})
    if cfg["mupfl-pkcf"]:
        grad = Tensor((dims.num_classes, dims.feature_dim), "float32")
        records[MUPFL_GRADS] = ArraysSpec({str(k): grad for k in range(dims.num_classes)}, partial=True)
        records[MUPFL_TIMES] = MetricsSpec({"grads-seconds": Number(float, 0.0, required=True)})
    return records


def _mupfl_downlink(dims: Dims) -> dict[str, Spec]:
    """PKCF: the classifier the gradients are taken at and, from round 2 on, the synthetic features
    with their labels; init "personal": the global model w_glo beside the client's own start."""
    cfg, c, d = dims.cfg, dims.num_classes, dims.feature_dim
    records: dict[str, Spec] = {}
    if cfg["mupfl-pkcf"]:
        records[MUPFL_CLASSIFIER] = ArraysSpec({"weight": Tensor((c, d), "float32")})
        feats = {"features": Tensor((None, d), "float32"), "labels": Tensor((None,), "int64", low=0, high=c - 1)}
        records[MUPFL_FEATURES] = ArraysSpec(feats, required=False)
    if cfg["mupfl-init"] == "personal":
        records[MUPFL_GLOBAL] = ArraysSpec(dict(dims.model))
    return records


MUPFL = Wire(
    {
        "start-accuracy": FRACTION,
        "finetune-loss": NON_NEGATIVE,
        "pkcf-client-seconds": NON_NEGATIVE,
        "bavd-seconds": NON_NEGATIVE,
    },
    _mupfl_uplink,
    _mupfl_downlink,
)
