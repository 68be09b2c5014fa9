"""The card of `ditto`: its classes, run-config keys, wire and paper.

Its code: server `strategies/ditto.py`; client `client_app/ditto.py`; maths `losses/proximal.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

# The personal model v_k never leaves the client: only its training loss and distance to w^t do.
WIRE = Wire({"ditto-loss": NON_NEGATIVE, "ditto-distance": NON_NEGATIVE})


METHOD = MethodSpec(
    "ditto",
    strategy="fedskew.strategies.ditto:DittoStrategy",
    trainer="fedskew.client_app.ditto:DittoTrainer",
    paper='Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021',
    wire=WIRE,
    params={
        "ditto-lambda": Param(
            float,
            1.0,
            "Ditto: lambda of the personal objective F_k(v) + lambda/2 ||v - w^t||^2 (code: 1)",
            low=0.0,
        ),
        "ditto-personal-epochs": Param(
            int,
            -1,
            "Ditto: personal epochs per round (-1: local-epochs, as the authors' code; at most 1000)",
            low=-1,
            high=1000,
        ),
    },
)
