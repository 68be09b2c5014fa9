"""The card of `fedavg`: its classes, run-config keys, wire and paper.

Its code: server ; client .
"""

from __future__ import annotations

from fedskew.methods.card import MethodSpec

METHOD = MethodSpec(
    "fedavg",
    strategy="fedskew.strategies.fedavg:FedAvgStrategy",
    trainer="fedskew.client_app.fedavg:FedAvgTrainer",
    any_classifier=True,
    paper='McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017',
)
