"""The card of `fedrod`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedrod.py`; client `client_app/fedrod.py`; maths `losses/fedrod.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

# Uplink: body and generic head; the personalized head stays on the client.
WIRE = Wire({"fedrod-bsm-loss": NON_NEGATIVE, "fedrod-personal-loss": NON_NEGATIVE})


METHOD = MethodSpec(
    "fedrod",
    strategy="fedskew.strategies.fedrod:FedRoDStrategy",
    trainer="fedskew.client_app.fedrod:FedRoDTrainer",
    paper='Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", ICLR 2022',
    wire=WIRE,
    params={
        "fedrod-gamma": Param(
            float, 1.0, "FedRoD: balanced softmax, logits + gamma log N_c (1: Ren et al.'s BSM)", low=0.0
        ),
    },
)
