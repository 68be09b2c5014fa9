"""The card of `fedproto`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedproto.py` (+ `strategies/prototypes.py`); client
`client_app/fedproto.py`; maths `losses/fedproto.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import NON_NEGATIVE, Number
from fedskew.schema import Param
from fedskew.wire import Wire, prototype_downlink, prototype_uplink

# Only prototypes travel: the uploaded and the sent model `arrays` are empty ArrayRecords (the
# screen refuses any array in them), the prototypes go both ways in `fedproto-prototypes`.
FEDPROTO_PROTOTYPES = "fedproto-prototypes"

WIRE = Wire(
    {"proto-loss": NON_NEGATIVE, "prototype-inference": Number(int, 0, 1)},
    prototype_uplink(FEDPROTO_PROTOTYPES),
    prototype_downlink(FEDPROTO_PROTOTYPES, required=True),
)


METHOD = MethodSpec(
    "fedproto",
    strategy="fedskew.strategies.fedproto:FedProtoStrategy",
    trainer="fedskew.client_app.fedproto:FedProtoTrainer",
    paper='Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022',
    wire=WIRE,
    params={
        "fedproto-lambda": Param(
            float,
            1.0,
            "FedProto: weight of the prototype distance (authors' code 1; its CIFAR-10 command 0.1)",
            low=0.0,
        ),
        "fedproto-weighting": Param(
            str,
            "counts",
            "FedProto: global prototype = sample-weighted mean over the holders (paper) or plain mean (code)",
            choices=("counts", "clients"),
        ),
        "fedproto-inference": Param(
            str,
            "prototype",
            "FedProto: personal prediction by the nearest global prototype (paper) or by the model's head",
            choices=("prototype", "classifier"),
        ),
    },
)
