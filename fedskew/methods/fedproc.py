"""The card of `fedproc`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedproc.py` (+ `strategies/prototypes.py`); client
`client_app/fedproc.py` (+ `client_app/prototypes.py`); maths `losses/fedproc.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.records import FRACTION, NON_NEGATIVE, Number
from fedskew.schema import Param
from fedskew.wire import Wire, prototype_downlink, prototype_uplink

FEDPROC_PROTOTYPES = "fedproc-prototypes"
WIRE = Wire(
    {"proto-loss": NON_NEGATIVE, "proto-alpha": FRACTION, "proto-active": Number(int, 0, 1)},
    prototype_uplink(FEDPROC_PROTOTYPES),
    prototype_downlink(FEDPROC_PROTOTYPES),
)


METHOD = MethodSpec(
    "fedproc",
    strategy="fedskew.strategies.fedproc:FedProcStrategy",
    trainer="fedskew.client_app.fedproc:FedProcTrainer",
    paper=(
        'Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID Data", FGCS 2023 '
        "(arXiv 2109.12273)"
    ),
    wire=WIRE,
    params={
        "fedproc-schedule": Param(
            str,
            "anneal",
            "FedProc: prototype-loss weight alpha_t = 1 - (t-1)/(R-1) ('anneal') or fedproc-alpha ('constant')",
            choices=("anneal", "constant"),
        ),
        "fedproc-alpha": Param(float, 0.5, "FedProc 'constant': L = alpha L_pc + (1 - alpha) CE", low=0.0, high=1.0),
        "fedproc-temperature": Param(
            float,
            1.0,
            "FedProc: temperature of the prototypical contrastive loss (1: the public re-implementation's cosine)",
            low=0.0,
            low_open=True,
        ),
    },
)
