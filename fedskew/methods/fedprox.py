"""The card of `fedprox`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fedprox.py`; client `client_app/fedprox.py`; maths
`losses/proximal.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec
from fedskew.schema import Param

METHOD = MethodSpec(
    "fedprox",
    strategy="fedskew.strategies.fedprox:FedProxStrategy",
    trainer="fedskew.client_app.fedprox:FedProxTrainer",
    any_classifier=True,
    paper='Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020',
    params={
        "fedprox-mu": Param(float, 0.01, "FedProx proximal weight: loss + mu/2 ||w - w_global||^2", low=0.0),
    },
)
