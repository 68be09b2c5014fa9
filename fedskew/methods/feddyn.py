"""The card of `feddyn`: its classes, run-config keys, wire and paper.

Its code: server `strategies/feddyn.py`; client `client_app/feddyn.py`; maths `losses/feddyn.py`,
`strategies/aggregate.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE
from fedskew.schema import Param
from fedskew.wire import Wire

# Nothing beyond the model: the server state h follows from the models it sent and received.
WIRE = Wire({"feddyn-gradient-norm": NON_NEGATIVE})


METHOD = MethodSpec(
    "feddyn",
    strategy="fedskew.strategies.feddyn:FedDynStrategy",
    trainer="fedskew.client_app.feddyn:FedDynTrainer",
    paper='Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021',
    wire=WIRE,
    params={
        "feddyn-alpha": Param(
            float,
            0.01,
            "FedDyn: weight alpha of the dynamic regulariser and of h (the authors' code: 0.01)",
            low=0.0,
            low_open=True,
        ),
    },
)
