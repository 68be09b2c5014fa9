"""What crosses the network: the records every method sends, and the forms a method's own records
are built from. A method declares its own (`Wire`: metrics, uplink, downlink) once, on its card
(`fedskew/methods/<name>.py`); its strategy and its trainer both read it from there.

Every train message carries the model (`arrays`), the round's `config` and the method's downlink
records; every reply carries the uploaded `arrays`, the `metrics` (`CLIENT_METRICS` plus the
method's own) and the method's uplink records. A `Wire` declares them as functions of `Dims` (the
run config and the shapes of the method's plain network), so that the server's base strategy
screens replies and the client's base trainer checks server messages against one declaration
(`fedskew.records.check_content`).

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
    MetricsSpec,
    Number,
    Spec,
    Tensor,
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
        classes, features, forms, params = _network(cfg["model"], info, bool(cfg.get("classifier-bias", False)))
        forms = dict(forms)
        return cls(cfg, info, classes, features, forms, {k: forms[k] for k in params})


@functools.lru_cache(maxsize=8)
def _network(
    model: str, info: DatasetInfo, bias: bool
) -> tuple[int, int, tuple[tuple[str, Tensor], ...], tuple[str, ...]]:
    """(classes, feature dimension, state-dict forms, parameter names) of the network `model` for
    data `info` (with a classifier bias if `bias`), built once per process (a client builds its
    trainer every round)."""
    from fedskew.models import build_model
    from fedskew.records import tensor_like

    net = build_model(model, info, bias)
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


# ------------------------------------------------------------------- CReFF's class gradients
def class_gradient_record(dims: Dims) -> ArraysSpec:
    """Uplink: one classifier gradient z_i^k (K x d) per class k the client holds, named "k" (any
    subset of the classes; MuPFL's PKCF and CReFF)."""
    grad = Tensor((dims.num_classes, dims.feature_dim), "float32")
    return ArraysSpec({str(k): grad for k in range(dims.num_classes)}, partial=True)


def classifier_record(dims: Dims) -> ArraysSpec:
    """Downlink: the classifier W (K x d) the clients take their class gradients at."""
    return ArraysSpec({"weight": Tensor((dims.num_classes, dims.feature_dim), "float32")})
