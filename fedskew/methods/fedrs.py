"""The card of `fedrs`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedrs.py`; client `client_app/fedrs.py`; maths
`losses/restricted_softmax.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

WIRE = Wire({"observed-classes": NON_NEGATIVE})


METHOD = MethodSpec(
    "fedrs",
    strategy="fedskew.strategies.fedrs:FedRSStrategy",
    trainer="fedskew.client_app.fedrs:FedRSTrainer",
    paper=(
        'Li & Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data", KDD 2021'
    ),
    wire=WIRE,
    params={
        "fedrs-alpha": Param(float, 0.5, "FedRS: scale of missing classes' logits", low=0.0, high=1.0),
        "fedrs-scale": Param(
            str, "binary", "FedRS: 'binary' (paper) or 'count' (authors' code)", choices=("binary", "count")
        ),
        "fedrs-tau": Param(int, 1, "FedRS: a class is observed when the client has >= tau samples", low=1),
    },
)
