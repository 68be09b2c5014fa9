"""The card of `fedrep`: its classes, run-config keys, wire and paper.

Its code: server ; client .
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

# Body only, both ways (`FedRepStrategy.expected_upload`); the head stays on the client.
WIRE = Wire({"fedrep-head-loss": NON_NEGATIVE})


METHOD = MethodSpec(
    "fedrep",
    strategy="fedskew.strategies.fedrep:FedRepStrategy",
    trainer="fedskew.client_app.fedrep:FedRepTrainer",
    paper=(
        'Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for Personalized '
        'Federated Learning", ICML 2021'
    ),
    revision=1,  # 1: no weight decay on biases, as the authors' code
    wire=WIRE,
    params={
        "fedrep-head-epochs": Param(
            int,
            10,
            "FedRep: head epochs (body frozen) before the local-epochs body epochs (code: 10; at most 1000)",
            low=0,
            high=1000,
        ),
    },
)
