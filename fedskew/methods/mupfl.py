"""The card of `mupfl`: its classes, run-config keys, wire and paper.

Its code: server `strategies/mupfl.py` (+ `strategies/clustering.py`); client `client_app/mupfl.py`;
maths `losses/mupfl.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import FRACTION, NON_NEGATIVE, ArraysSpec, MetricsSpec, Number, Spec, Tensor
from fedskew.schema import Param
from fedskew.wire import Dims, Wire, class_gradient_record, classifier_record

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


WIRE = Wire(
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


METHOD = MethodSpec(
    "mupfl",
    strategy="fedskew.strategies.mupfl:MuPFLStrategy",
    trainer="fedskew.client_app.mupfl:MuPFLTrainer",
    paper=(
        'Zhang et al., "Multi-level Personalized Federated Learning on Heterogeneous and Long-Tailed '
        'Data" (MuPFL; extends ICME 2023)'
    ),
    wire=WIRE,
    params={
        "mupfl-bavd": Param(bool, True, "MuPFL: BAVD dropout during local training (and maps for ACMU)"),
        "mupfl-acmu": Param(bool, True, "MuPFL: ACMU cluster update (off = one cluster)"),
        "mupfl-pkcf": Param(bool, True, "MuPFL: PKCF class gradients, feature synthesis, classifier fine-tune"),
        "mupfl-init": Param(
            str,
            "global",
            "MuPFL: a client starts from the global model (Alg. 1 as FedAvg with clustering), its own w~_i"
            " ('personal'), or its w~_i's feature extractor with the global classifier ('cluster', Eq. 14"
            " on the client's path)",
            choices=("global", "personal", "cluster"),
        ),
        "mupfl-alpha": Param(
            float, 0.5, "MuPFL ACMU: weight of the update cosine vs the map cosine", low=0.0, high=1.0
        ),
        "mupfl-k-min": Param(int, 2, "MuPFL ACMU: smallest number of clusters tried", low=2),
        "mupfl-k-max": Param(int, 6, "MuPFL ACMU: largest number of clusters tried (capped at n-1)", low=2),
        "mupfl-psi-sign": Param(
            str,
            "improvement",
            "MuPFL BAVD: psi = prev - cur loss, or the paper's cur - prev",
            choices=("improvement", "paper"),
        ),
        "mupfl-bavd-rescale": Param(
            bool, False, "MuPFL BAVD: scale kept activations by positions / kept (inverted dropout)"
        ),
        "mupfl-bavd-mask": Param(
            str,
            "sample-topk",
            "MuPFL BAVD: per sample its top-K ('sample-topk', Sec. 3.6), or its own mean ('sample-mean'),"
            " or the map's mean as its threshold ('map-threshold'), or one mask from the batch-mean map"
            " for every sample ('batch')",
            choices=("batch", "sample-mean", "sample-topk", "map-threshold"),
        ),
        "mupfl-bavd-top": Param(
            float,
            0.5,
            "MuPFL BAVD 'sample-topk': the fraction K of each sample-channel slice kept (the paper gives none)",
            low=0.0,
            high=1.0,
            low_open=True,
        ),
        "mupfl-bavd-site": Param(
            str,
            "features",
            "MuPFL BAVD: on the flattened features before the classifier ('features'), after every conv"
            " block ('convs'), or after the last only ('last-conv')",
            choices=("convs", "last-conv", "features"),
        ),
        "mupfl-bavd-reset": Param(
            str,
            "epoch",
            "MuPFL BAVD: map restarts each epoch, each round, or never (client state)",
            choices=("epoch", "round", "never"),
        ),
        "mupfl-features-per-class": Param(
            int,
            20,
            "MuPFL PKCF: synthetic features per class (m; the paper studies 10 to 200, Sec. 4.1; at most 1000: "
            "the server holds classes x m x feature-dim floats and sends them every round)",
            low=1,
            high=1000,
        ),
        "mupfl-tau": Param(
            int,
            30,
            "MuPFL PKCF: classifier fine-tune epochs on the features (the paper studies 10 to 100, Sec. 4.1; "
            "at most 1000)",
            low=0,
            high=1000,
        ),
        "mupfl-feature-batch": Param(int, 64, "MuPFL PKCF: batch size of the classifier fine-tune", low=1),
        "mupfl-feature-init": Param(
            str,
            "extractor",
            "MuPFL PKCF: synthetic features start as the global extractor's outputs (Sec. 3.5, on"
            " N(0,1) inputs), N(0,1) (CReFF), or N(0,1) rescaled to the clients' real-feature norm",
            choices=("normal", "extractor", "rescaled"),
        ),
        "mupfl-feature-lr": Param(float, 1.0, "MuPFL PKCF: SGD lr of the feature synthesis", low=0.0, low_open=True),
        "mupfl-match-iters": Param(
            int,
            100,
            "MuPFL PKCF: gradient-matching iterations per round (CReFF: 100; at most 10,000)",
            low=0,
            high=10_000,
        ),
        "mupfl-distance": Param(
            str,
            "creff",
            "MuPFL PKCF: matching distance, CReFF's row-wise cosine summed over rows and classes,"
            " or the paper's one cosine per class averaged (Eq. 20)",
            choices=("creff", "paper"),
        ),
        "mupfl-n-real": Param(int, 64, "MuPFL PKCF: samples per class for a client's class gradient", low=1),
    },
)
