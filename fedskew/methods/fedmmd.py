"""The card of `fedmmd`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedmmd.py`; client `client_app/fedmmd.py`; maths `losses/map.py`
(`mmd_multi_gaussian`).
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import Number
from fedskew.schema import Param
from fedskew.wire import Wire

# MMD^2 is a squared RKHS norm; its float32 V-statistic can land a rounding error below 0
WIRE = Wire({"mmd-loss": Number(float, -1e-4)})


METHOD = MethodSpec(
    "fedmmd",
    strategy="fedskew.strategies.fedmmd:FedMMDStrategy",
    trainer="fedskew.client_app.fedmmd:FedMMDTrainer",
    paper='Yao, Huang & Sun, "Two-Stream Federated Learning: Reduce the Communication Costs", VCIP 2018',
    wire=WIRE,
    params={
        "fedmmd-lambda": Param(
            float,
            1e-3,
            "FedMMD: weight of the feature MMD to the global model (FedRS ran 1e-4 and 1e-3)",
            low=0.0,
        ),
    },
)
