"""The card of `map`: its classes, run-config keys, wire and paper.

Its code: server `strategies/map.py` (+ `strategies/hpm.py`); client `client_app/map.py` (+
`client_app/hpm.py`); maths `losses/map.py`.
"""

from __future__ import annotations

from fedskew.methods import fedrs
from fedskew.methods.card import MethodSpec
from fedskew.methods.fedphp import HPM_METRICS, hpm_keys
from fedskew.records import Number
from fedskew.schema import Param

WIRE = fedrs.WIRE.extend(
    {
        "stage2-loss": Number(float, 0.0, nan=True),  # NaN: no stage 2 (map-personal-epochs=0)
        "stage2-accuracy": Number(float, 0.0, 1.0, nan=True),  # NaN: no local test data
        **HPM_METRICS,
        "hpm-transfer": Number(int, 0, 1),
    }
)


METHOD = MethodSpec(
    "map",
    strategy="fedskew.strategies.map:MAPStrategy",
    trainer="fedskew.client_app.map:MAPTrainer",
    paper=(
        'Li et al., "MAP: Model Aggregation and Personalization in Federated Learning with Incomplete '
        'Classes", TKDE 2024'
    ),
    wire=WIRE,
    params={
        "map-alpha": Param(
            float, 0.5, "MAP stage 1: restricted-softmax scale of missing classes' logits", low=0.0, high=1.0
        ),
        "map-scale": Param(
            str,
            "binary",
            "MAP: RS rule, 'binary' (paper), 'count', or 'fraction' (authors' code: tau on class"
            " fractions, so every logit x alpha on a client with 2+ classes)",
            choices=("binary", "count", "fraction"),
        ),
        "map-tau": Param(int, 1, "MAP: a class is observed when the client has >= tau samples", low=1),
        **hpm_keys("map", "MAP", soften_student=True, mu_max=1.0),
        "map-personal-epochs": Param(
            int, 1, "MAP: stage-2 (personalization) epochs under schedule 'epochs' (at most 1000)", low=0, high=1000
        ),
        "map-personal-lr-factor": Param(
            float, 1.0, "MAP: stage-2 lr = lr * factor (code: 0.2)", low=0.0, low_open=True
        ),
        "map-schedule": Param(
            str,
            "algorithm1",
            "MAP stage lengths: local-epochs split in halves (Alg. 1 as printed: 'algorithm1'),"
            " local-epochs + map-personal-epochs ('epochs'), or the authors' code's steps ('code':"
            " max(E nb, 5), then max(int(0.1 x that), 5); int(Q T) in mu)",
            choices=("algorithm1", "epochs", "code"),
        ),
        "map-hpm-init": Param(
            str,
            "none",
            "MAP: a first participation has no HPM (paper) or the initial model as its HPM ('initial', code)",
            choices=("none", "initial"),
        ),
        "map-uniform-aggregation": Param(
            bool,
            True,
            "MAP: average uploads uniformly (Alg. 1 line 6); false = aggregation-weights (code, FedAvg)",
        ),
    },
)
