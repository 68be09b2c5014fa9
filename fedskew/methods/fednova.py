"""The card of `fednova`: its classes, run-config keys, wire and paper.

Its code: server `strategies/fednova.py`; client `client_app/fednova.py`; maths
`strategies/aggregate.py`.
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec

METHOD = MethodSpec(
    "fednova",
    strategy="fedskew.strategies.fednova:FedNovaStrategy",
    trainer="fedskew.client_app.fednova:FedNovaTrainer",
    any_classifier=True,
    paper=(
        'Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated '
        'Optimization", NeurIPS 2020'
    ),
)
