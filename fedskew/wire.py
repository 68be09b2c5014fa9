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
# With `personalized-central-eval`, and only then: the personalized model on the central test set,
# whole (the "generic accuracy" FedGELA and FedRoD report for personalized methods), over the classes
# the client holds and over those it lacks (`BaseTrainer.evaluate_central`).
CENTRAL_EVAL_METRICS: dict[str, Number] = {
    "personal-central-accuracy": FRACTION,
    "personal-held-accuracy": FRACTION,
    "personal-missing-accuracy": FRACTION,
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
    params: Mapping[str, Tensor]  # its trainable parameters (no buffers), name -> form

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> Dims:
        from fedskew.data import dataset_info

        info = dataset_info(dict(cfg))
        classes, features, forms, params = _network(cfg["model"], info)
        forms = dict(forms)
        return cls(cfg, info, classes, features, forms, {k: forms[k] for k in params})


@functools.lru_cache(maxsize=8)
def _network(model: str, info: DatasetInfo) -> tuple[int, int, tuple[tuple[str, Tensor], ...], tuple[str, ...]]:
    """(classes, feature dimension, state-dict forms, parameter names) of the network `model` for
    data `info`, built once per process (a client builds its trainer every round)."""
    from fedskew.models import build_model
    from fedskew.records import tensor_like

    net = build_model(model, info)
    forms = tuple((k, tensor_like(v)) for k, v in net.state_dict().items())
    return net.num_classes, net.feature_dim, forms, tuple(k for k, _ in net.named_parameters())


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
        central = CENTRAL_EVAL_METRICS if dims.cfg["personalized-central-eval"] else {}
        return {
            MODEL: ArraysSpec(dict(upload)),
            METRICS: MetricsSpec({**CLIENT_METRICS, **central, **self.metrics}),
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
MAX_PARTITIONS = 1_000_000  # the longest per-partition list a message may carry


def prototype_uplink(record: str) -> Records:
    """A client's per-class mean features and counts {prototypes [C, d] float32, counts [C] int64 >= 0}
    (FedMR, FedProc): rows of classes it does not report are zero."""

    def records(dims: Dims) -> dict[str, Spec]:
        c, d = dims.num_classes, dims.feature_dim
        protos = {"prototypes": Tensor((c, d), "float32"), "counts": Tensor((c,), "int64", low=0)}
        return {record: ArraysSpec(protos)}

    return records


def prototype_downlink(record: str, required: bool = False) -> Records:
    """The global prototypes and which classes have one {prototypes [C, d] float32, valid [C] bool}
    (not `required`: absent in round 1, when no class has one yet)."""

    def records(dims: Dims) -> dict[str, Spec]:
        c, d = dims.num_classes, dims.feature_dim
        protos = {"prototypes": Tensor((c, d), "float32"), "valid": Tensor((c,), "bool")}
        return {record: ArraysSpec(protos, required=required)}

    return records


# ---------------------------------------------------------------------------------------- FedMR
FEDMR_PROTOTYPES = "fedmr-prototypes"
FEDMR_CONFIG = "fedmr-config"


def _fedmr_config(dims: Dims) -> dict[str, Spec]:
    return {FEDMR_CONFIG: ConfigSpec({"share-mask": Flags(MAX_PARTITIONS, required=True)}, required=False)}


FEDMR = Wire(
    {
        "intra-loss": NON_NEGATIVE,
        "inter-loss": NON_NEGATIVE,
        "inter-active": FRACTION,
        "prototypes-shared": FRACTION,
        "intra-grad-share": NON_NEGATIVE,  # ||grad_body mu1 l_intra|| / ||grad_body CE||, round mean
        "inter-grad-share": NON_NEGATIVE,  # ||grad_body mu2 l_inter|| / ||grad_body CE||
    },
    prototype_uplink(FEDMR_PROTOTYPES),
    prototype_downlink(FEDMR_PROTOTYPES),
).extend(downlink=_fedmr_config)

# ---------------------------------------------------------------------------------------- FedProc
FEDPROC_PROTOTYPES = "fedproc-prototypes"
FEDPROC = Wire(
    {"proto-loss": NON_NEGATIVE, "proto-alpha": FRACTION, "proto-active": Number(int, 0, 1)},
    prototype_uplink(FEDPROC_PROTOTYPES),
    prototype_downlink(FEDPROC_PROTOTYPES),
)

# ---------------------------------------------------------------------------------------- MOON
# moon-negative: 1 when the client had its previous local model (the negative), 0 at a first participation
MOON = Wire({"moon-loss": NON_NEGATIVE, "moon-negative": Number(int, 0, 1)})

# ---------------------------------------------------------------------------------------- FedMMD
# MMD^2 is a squared RKHS norm; its float32 V-statistic can land a rounding error below 0
FEDMMD = Wire({"mmd-loss": Number(float, -1e-4)})

# ---------------------------------------------------------------------------------------- FedProto
# Only prototypes travel: the uploaded and the sent model `arrays` are empty ArrayRecords (the
# screen refuses any array in them), the prototypes go both ways in `fedproto-prototypes`.
FEDPROTO_PROTOTYPES = "fedproto-prototypes"

FEDPROTO = Wire(
    {"proto-loss": NON_NEGATIVE, "prototype-inference": Number(int, 0, 1)},
    prototype_uplink(FEDPROTO_PROTOTYPES),
    prototype_downlink(FEDPROTO_PROTOTYPES, required=True),
)

# ---------------------------------------------------------------------------------------- FedGELA
FEDGELA_ETF = "etf"
FEDGELA_ETF_INFO = "etf-info"


def _fedgela_downlink(dims: Dims) -> dict[str, Spec]:
    etf = Tensor((dims.feature_dim, dims.num_classes), "float32", -1.0, 1.0)  # unit-norm columns
    info = {"sha256": Text(64, "0123456789abcdef", required=True), "seed": Number(int, 0)}
    return {FEDGELA_ETF: ArraysSpec({"etf": etf}), FEDGELA_ETF_INFO: ConfigSpec(info)}


FEDGELA = Wire(downlink=_fedgela_downlink)


# ------------------------------------------------------------------- CReFF's class gradients
def class_gradient_record(dims: Dims) -> ArraysSpec:
    """Uplink: one classifier gradient z_i^k (K x d) per class k the client holds, named "k" (any
    subset of the classes; MuPFL's PKCF and CReFF)."""
    grad = Tensor((dims.num_classes, dims.feature_dim), "float32")
    return ArraysSpec({str(k): grad for k in range(dims.num_classes)}, partial=True)


def classifier_record(dims: Dims) -> ArraysSpec:
    """Downlink: the classifier W (K x d) the clients take their class gradients at."""
    return ArraysSpec({"weight": Tensor((dims.num_classes, dims.feature_dim), "float32")})


# ---------------------------------------------------------------------------------------- MuPFL
MUPFL_FEATURES = "mupfl-features"
MUPFL_MAPS = "mupfl-map"
MUPFL_GRADS = "mupfl-grads"
MUPFL_CLASSIFIER = "mupfl-classifier"
MUPFL_GLOBAL = "mupfl-global"
MUPFL_TIMES = "mupfl-times"


def _mupfl_uplink(dims: Dims) -> dict[str, Spec]:
    """The flattened BAVD maps (BAVD on and layers to hook at `mupfl-bavd-site`) and, with PKCF, one
    classifier gradient per class the client holds, their timing and the mean norm of the real
    features they were taken on."""
    from fedskew.losses.mupfl import bavd_map_size
    from fedskew.models import build_model

    cfg, records = dims.cfg, {}
    model = build_model(cfg["model"], dims.info)
    size = bavd_map_size(model, dims.info, cfg["mupfl-bavd-site"]) if cfg["mupfl-bavd"] else 0
    if size:
        records[MUPFL_MAPS] = ArraysSpec({"map": Tensor((size,), "float32")})
    if cfg["mupfl-pkcf"]:
        records[MUPFL_GRADS] = class_gradient_record(dims)
        times = {"grads-seconds": Number(float, 0.0, required=True), "real-norm": Number(float, 0.0, required=True)}
        records[MUPFL_TIMES] = MetricsSpec(times)
    return records


def _mupfl_downlink(dims: Dims) -> dict[str, Spec]:
    """PKCF: the classifier the gradients are taken at and, from round 2 on, the synthetic features
    with their labels; init "personal" / "cluster": the global model w_glo beside the client's own start."""
    cfg, c, d = dims.cfg, dims.num_classes, dims.feature_dim
    records: dict[str, Spec] = {}
    if cfg["mupfl-pkcf"]:
        records[MUPFL_CLASSIFIER] = classifier_record(dims)
        feats = {"features": Tensor((None, d), "float32"), "labels": Tensor((None,), "int64", low=0, high=c - 1)}
        records[MUPFL_FEATURES] = ArraysSpec(feats, required=False)
    if cfg["mupfl-init"] != "global":
        records[MUPFL_GLOBAL] = ArraysSpec(dict(dims.model))
    return records


MUPFL = Wire(
    {
        "start-accuracy": FRACTION,
        "pkcf-accuracy": FRACTION,
        "bavd-dropped-positions": FRACTION,
        "bavd-dropped-mass": FRACTION,
        "finetune-loss": NON_NEGATIVE,
        "pkcf-client-seconds": NON_NEGATIVE,
        "bavd-seconds": NON_NEGATIVE,
    },
    _mupfl_uplink,
    _mupfl_downlink,
)

# ---------------------------------------------------------------------------------------- SCAFFOLD
# The server control variate c travels down (one array per trainable parameter); nothing but the
# model travels up: option II's client update Delta c_i = (x - y_i) / (K_i eta_l) - c is computed by
# the server from the model it sent, the model it received, its own c and K_i (`strategies/scaffold.py`).
CONTROL = "control"


def _control_downlink(dims: Dims) -> dict[str, Spec]:
    return {CONTROL: ArraysSpec(dict(dims.params))}


SCAFFOLD = Wire({"correction-norm": NON_NEGATIVE}, downlink=_control_downlink)  # ||c - c_i|| of the round
SCAFFOLD_RS = SCAFFOLD.extend(FEDRS.metrics)

# ---------------------------------------------------------------------------------------- FedNova
# Nothing beyond the model: the server computes each client's local step count and a_i itself.
FEDNOVA = BASE

# ---------------------------------------------------------------------------------------- FedDyn
# Nothing beyond the model: the server state h follows from the models it sent and received.
FEDDYN = Wire({"feddyn-gradient-norm": NON_NEGATIVE})

# ---------------------------------------------------------------------------------------- FedDC
# Down: the gradient-correction control c (as SCAFFOLD's). Up: the drift-corrected model theta_i + h_i
# as the model arrays, and the local update theta_i - w (`feddc-update`, one array per trainable
# parameter), from which the server updates c.
FEDDC_UPDATE = "feddc-update"


def _feddc_uplink(dims: Dims) -> dict[str, Spec]:
    return {FEDDC_UPDATE: ArraysSpec(dict(dims.params))}


FEDDC = SCAFFOLD.extend({"feddc-drift-norm": NON_NEGATIVE}, _feddc_uplink)

# ---------------------------------------------------------------------------------------- CReFF
CREFF_GRADS = "creff-grads"
CREFF_CLASSIFIER = "creff-classifier"

CREFF = Wire(
    uplink=lambda dims: {CREFF_GRADS: class_gradient_record(dims)},
    downlink=lambda dims: {CREFF_CLASSIFIER: classifier_record(dims)},
)

# ---------------------------------------------------------------------------------------- FedGen
FEDGEN_COUNTS = "fedgen-counts"
FEDGEN_GENERATOR = "fedgen-generator"


def _fedgen_uplink(dims: Dims) -> dict[str, Spec]:
    """The client's label counts n_k^y over its training set (they sum to its num-examples:
    `FedGenStrategy.check_reply`)."""
    return {FEDGEN_COUNTS: ArraysSpec({"counts": Tensor((dims.num_classes,), "int64", low=0)})}


def _fedgen_downlink(dims: Dims) -> dict[str, Spec]:
    """The server's generator G(z | y) (its state dict: weights and BatchNorm statistics), sent
    once it has been trained (from round 2 on)."""
    from fedskew.losses.fedgen import build_generator
    from fedskew.records import tensor_like

    forms = {
        k: tensor_like(v) for k, v in build_generator(dims.cfg, dims.num_classes, dims.feature_dim).state_dict().items()
    }
    return {FEDGEN_GENERATOR: ArraysSpec(forms, required=False)}


FEDGEN = Wire(
    {"fedgen-teacher-loss": NON_NEGATIVE, "fedgen-latent-loss": NON_NEGATIVE},
    _fedgen_uplink,
    _fedgen_downlink,
)
# ---------------------------------------------------------------------------------------- Ditto
# The personal model v_k never leaves the client: only its training loss and distance to w^t do.
DITTO = Wire({"ditto-loss": NON_NEGATIVE, "ditto-distance": NON_NEGATIVE})

# ---------------------------------------------------------------------------------------- FedRep
# Body only, both ways (`FedRepStrategy.expected_upload`); the head stays on the client.
FEDREP = Wire({"fedrep-head-loss": NON_NEGATIVE})

# ---------------------------------------------------------------------------------------- FedBABU
# Uplink: the body only (`FedBABUStrategy.expected_upload`); the fixed head travels down only.
FEDBABU = Wire({"fedbabu-finetune-loss": NON_NEGATIVE})

# ---------------------------------------------------------------------------------------- FedRoD
# Uplink: body and generic head; the personalized head stays on the client.
FEDROD = Wire({"fedrod-bsm-loss": NON_NEGATIVE, "fedrod-personal-loss": NON_NEGATIVE})
